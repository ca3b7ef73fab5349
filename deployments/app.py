"""Application builder: `import_path: rankserve.deployments.app:build_app` in configs/serve*.yaml.

`args` (the Serve config's application args) name the families and the shared services; each family becomes a
`Worker-<family>` deployment whose replica policy (autoscaling_config, max_ongoing_requests, ray_actor_options)
is that name's entry under the config's `deployments`, the Router being `Router`.

    args:
      redis_url: redis://host:6379/0      # omit for no rank cache
      api_key_env: RANKSERVE_API_KEY       # omit for no auth
      embed_device: cpu
      rank_cache: {threshold: 0.9, max_entries: 10000}
      families:
        svd-llm: {model_dir: ..., device: cuda, dtype: bfloat16, max_tokens: 1024, request_timeout_s: 120}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ray.serve import Application

from rankserve.deployments.router import Router
from rankserve.deployments.worker import FamilySpec, Worker


@dataclass
class AppArgs:
    families: dict[str, dict[str, Any]]
    redis_url: str | None = None
    api_key_env: str | None = None
    embed_device: str = "cpu"
    embed_threads: int = 1
    rank_cache: dict[str, Any] = field(default_factory=dict)  # RankCache options: threshold, max_entries, thresholds

    def __post_init__(self) -> None:
        if not self.families:
            raise ValueError("args.families is empty: name at least one family with its model_dir")
        unknown = set(self.rank_cache) - {"threshold", "max_entries", "thresholds", "redis_timeout_s"}
        if unknown:
            raise ValueError(f"args.rank_cache: unknown option(s) {sorted(unknown)}")


def build_app(args: dict[str, Any]) -> Application:
    """Serve config args -> the application: Router ingress bound to one Worker deployment per family."""
    try:
        cfg = AppArgs(**args)
        specs = {name: FamilySpec(**spec) for name, spec in cfg.families.items()}
    except TypeError as e:
        raise ValueError(f"bad rankserve application args: {e}") from None
    workers = {}
    for name, spec in specs.items():
        if ":" in name or not name:
            raise ValueError(f"family name {name!r} must be non-empty and contain no ':'")
        # Relative model dirs are taken from where Serve was started (the repo root for `make run`).
        spec.model_dir = str(Path(spec.model_dir).expanduser().absolute())
        workers[name] = Worker.options(name=f"Worker-{name}").bind(name, asdict(spec))
    limits = {name: {"max_tokens": spec.max_tokens} for name, spec in specs.items()}
    return Router.bind(workers, limits, redis_url=cfg.redis_url, rank_cache=cfg.rank_cache,
                       api_key_env=cfg.api_key_env, embed_device=cfg.embed_device, embed_threads=cfg.embed_threads)
