"""Load test of the local service: staged closed-loop concurrency over HTTP (streamed completions).

Each user sends a request, reads the SSE stream to the end, and sends the next one (no think time). A sampler
records replicas per deployment from `serve.status()` every second. After the last stage the test keeps sampling
until the busy family is back at its minimum replicas (the scale-down), then writes
`bench/results/load-<tag>.json` (per stage and overall: p50/p90/p99 latency, time to first token, throughput,
outcomes, rank-cache hit rate, router overhead p50/p99, replicas over time) and `load-<tag>.png`.

No request may be lost: each one ends as a complete stream (`data: [DONE]`) or is refused with a clear status
(408 / 429 / 503 with a JSON error body); anything else (a 500, a broken connection, a truncated stream) is
counted as `lost`.

    rankserve bench load --stages 20:1,60:8,30:2 --tag local-cpu
    python -m rankserve.bench.load --help
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
REFUSED = (408, 429, 503)  # clear refusals: the client may retry

OPENERS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball that he loved to play with.",
    "One day, a small bird flew into the garden.",
    "The sun was shining and the sky was blue.",
    "Sam and his mom went to the park to play.",
    "There was a kind old man who lived in a small house.",
    "A little cat wanted to find a friend.",
    "Sue found a shiny stone near the river.",
    "The big dog liked to run in the green grass.",
    "Ben was sad because his toy car was broken.",
]
NAMES = ["Lily", "Tom", "Sam", "Sue", "Ben", "Mia", "Max", "Anna"]
THINGS = ["a blue kite", "a yellow duck", "a tiny box", "a magic hat", "a soft bear", "an old map"]


def make_prompt(rng: random.Random) -> str:
    """Two thirds close variants of a few openers (rank-cache hits), one third new sentences (misses)."""
    if rng.random() < 2 / 3:
        p = rng.choice(OPENERS)
        return p if rng.random() < 0.5 else p.replace(".", "!") if rng.random() < 0.5 else p.replace(",", "")
    return f"{rng.choice(NAMES)} saw {rng.choice(THINGS)} and {rng.choice(THINGS)} near the {rng.choice(['lake', 'tree', 'school', 'shop'])}."


@dataclass
class Stage:
    duration_s: float
    users: int


@dataclass
class Record:
    family: str
    stage: int
    t_start: float  # seconds since the test began
    latency_s: float
    ttft_s: float | None
    status: int  # HTTP status, or 0 for a broken connection
    outcome: str  # "ok" | "refused" | "lost"
    tokens: int = 0
    cache: str | None = None  # "hit" | "miss"
    overhead_ms: float | None = None  # router: embed + rank-cache lookup
    lookup_ms: float | None = None  # router: rank-cache lookup alone
    error: str | None = None


@dataclass
class LoadConfig:
    stages: list[Stage]
    family: str = "svd-llm"  # the busy family
    other_share: float = 0.1  # fraction of requests to the other families
    max_tokens: int = 64
    cooldown_max_s: float = 120.0  # after the stages: wait at most this long for the scale-down
    seed: int = 0
    api_key: str | None = None
    families: list[str] = field(default_factory=list)


async def _one(client, url: str, cfg: LoadConfig, family: str, prompt: str, seed: int, stage: int,
               t0: float) -> Record:
    import httpx

    body = {"model": family, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True}
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.perf_counter()
    rec = Record(family, stage, start - t0, 0.0, None, 0, "lost")
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            rec.status = r.status_code
            rec.cache = r.headers.get("x-rankserve-rank-cache")
            oh, lk = r.headers.get("x-rankserve-overhead-ms"), r.headers.get("x-rankserve-lookup-ms")
            rec.overhead_ms = float(oh) if oh else None
            rec.lookup_ms = float(lk) if lk else None
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    rec.error = json.loads(raw)["error"]["message"]
                    rec.outcome = "refused" if r.status_code in REFUSED else "lost"
                except (ValueError, KeyError, TypeError):
                    rec.error = raw[:200].decode(errors="replace")
            else:
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = chunk["error"]["message"]
                        break
                    if chunk["choices"][0]["text"] and rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - start
                    if "usage" in chunk:
                        rec.tokens = chunk["usage"]["completion_tokens"]
                rec.outcome = "ok" if done else "lost"
                if not done and rec.error is None:
                    rec.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency_s = time.perf_counter() - start
    return rec


async def _drive(url: str, cfg: LoadConfig, records: list[Record], users_log: list[tuple[float, int]], t0: float):
    import httpx

    rng = random.Random(cfg.seed)
    others = [f for f in cfg.families if f != cfg.family]
    limits = httpx.Limits(max_connections=max(s.users for s in cfg.stages) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
        for i, stage in enumerate(cfg.stages):
            end = time.perf_counter() + stage.duration_s
            users_log.append((time.perf_counter() - t0, stage.users))

            async def user():
                while time.perf_counter() < end:
                    fam = rng.choice(others) if others and rng.random() < cfg.other_share else cfg.family
                    prompt, seed = make_prompt(rng), rng.randrange(1 << 30)
                    records.append(await _one(client, url, cfg, fam, prompt, seed, i, t0))

            await asyncio.gather(*(user() for _ in range(stage.users)))
        users_log.append((time.perf_counter() - t0, 0))


class ReplicaSampler(threading.Thread):
    """Polls serve.status() every `period_s`: [(t, {deployment: running replicas})]."""

    def __init__(self, app: str, t0: float, period_s: float = 1.0):
        super().__init__(daemon=True)
        self.app, self.t0, self.period_s = app, t0, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop_event.is_set():
            st = serve.status().applications.get(self.app)
            if st is not None:
                self.samples.append((time.perf_counter() - self.t0,
                                     {d: s.replica_states.get("RUNNING", 0) for d, s in st.deployments.items()}))
            self.stop_event.wait(self.period_s)

    def latest(self, deployment: str) -> int:
        return self.samples[-1][1].get(deployment, 0) if self.samples else 0


def _pct(xs: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    if not xs:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(np.percentile(xs, q)), 4) for q in qs}


def summarize(records: list[Record], span_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.outcome == "ok"]
    outcomes = {k: sum(r.outcome == k for r in records) for k in ("ok", "refused", "lost")}
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    cached = [r for r in records if r.cache]
    return {
        "requests": len(records), "outcomes": outcomes, "statuses": statuses,
        "latency_s": _pct([r.latency_s for r in ok]),
        "ttft_s": _pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        "throughput_rps": round(len(ok) / span_s, 3) if span_s > 0 else None,
        "throughput_tokens_per_s": round(sum(r.tokens for r in ok) / span_s, 2) if span_s > 0 else None,
        "rank_cache_hit_rate": round(sum(r.cache == "hit" for r in cached) / len(cached), 3) if cached else None,
        "router_overhead_ms": _pct([r.overhead_ms for r in records if r.overhead_ms is not None]),
        "rank_cache_lookup_ms": _pct([r.lookup_ms for r in records if r.lookup_ms is not None]),
    }


def run_load(
    stages: list[Stage],
    service=None,  # a started deployments.local.LocalService; None = start one from `config`
    config: str | Path = ROOT / "configs" / "serve.local.yaml",
    family: str = "svd-llm",
    other_share: float = 0.1,
    max_tokens: int = 64,
    cooldown_max_s: float = 120.0,
    out_dir: str | Path = RESULTS,
    tag: str = "local-cpu",
    seed: int = 0,
    plot: bool = True,
    family_options: dict[str, Any] | None = None,  # set on every family of `config` (e.g. join_running: False)
) -> dict[str, Any]:
    """Run the staged load, wait for the scale-down, write JSON (+ PNG); returns the results dict."""
    import yaml

    from rankserve.deployments.local import LocalService, ensure_models

    load_before = round(os.getloadavg()[0], 2)  # other work on the machine shows up in every figure below
    own = service is None
    if own:
        ensure_models()
        cfg_dict = yaml.safe_load(Path(config).read_text())
        for app in cfg_dict["applications"]:
            for fam in app["args"]["families"].values():
                fam.update(family_options or {})
        service = LocalService(cfg_dict).start()
    try:
        app = service.app
        key_env = app["args"].get("api_key_env")
        cfg = LoadConfig(stages, family, other_share, max_tokens, cooldown_max_s, seed,
                         api_key=(os.environ.get(key_env, "").split(",")[0] or None) if key_env else None,
                         families=sorted(app["args"]["families"]))
        if family not in cfg.families:
            raise ValueError(f"unknown family {family!r}; the config serves {cfg.families}")
        dep = f"Worker-{family}"
        min_replicas = next((d.get("autoscaling_config", {}).get("min_replicas", 1) for d in app["deployments"]
                             if d["name"] == dep), 1)
        records: list[Record] = []
        users_log: list[tuple[float, int]] = []
        t0 = time.perf_counter()
        sampler = ReplicaSampler(app["name"], t0)
        sampler.start()
        asyncio.run(_drive(service.http_url, cfg, records, users_log, t0))
        t_load_end = time.perf_counter() - t0
        while time.perf_counter() - t0 - t_load_end < cooldown_max_s and sampler.latest(dep) > min_replicas:
            time.sleep(1)
        time.sleep(2)  # one more sample at the floor
        sampler.stop_event.set()
        sampler.join()
    finally:
        if own:
            service.stop()

    stage_bounds = [0.0] + [t for t, _ in users_log[1:]]
    per_stage = []
    for i, s in enumerate(stages):
        recs = [r for r in records if r.stage == i]
        per_stage.append({"duration_s": s.duration_s, "users": s.users,
                          **summarize(recs, stage_bounds[i + 1] - stage_bounds[i])})
    peak = max((n.get(dep, 0) for _, n in sampler.samples), default=0)
    t_peak = next((t for t, n in sampler.samples if n.get(dep, 0) == peak), None)
    t_down = next((t for t, n in sampler.samples if t_peak is not None and t > t_peak and n.get(dep, 0) <= min_replicas),
                  None)  # the first sample back at the floor after the peak
    results = {
        "what": "staged closed-loop load over HTTP SSE against the local Ray Serve service",
        "config": {**asdict(cfg), "api_key": bool(cfg.api_key), "config_file": _rel(config) if own else "(given)",
                   "family_options": family_options or {}},
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform, "loadavg_1m_before": load_before,
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "overall": summarize(records, t_load_end),
        "stages": per_stage,
        "autoscaling": {"deployment": dep, "min_replicas": min_replicas, "peak_replicas": peak,
                        "t_peak_s": t_peak, "t_load_end_s": round(t_load_end, 2), "t_back_to_min_s": t_down,
                        "scaled_up": peak > min_replicas, "scaled_down": t_down is not None},
        "users_over_time": users_log,
        "replicas_over_time": [{"t": round(t, 2), **n} for t, n in sampler.samples],
        "requests": [asdict(r) for r in records],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"load-{tag}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    results["json_path"] = str(path)
    if plot:
        results["png_path"] = str(_plot(results, out_dir / f"load-{tag}.png"))
    return results


def _rel(path: str | Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in res["requests"] if r["outcome"] == "ok"]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ut = res["users_over_time"]
    ax[0].step([t for t, _ in ut], [u for _, u in ut], where="post", label="users (concurrency)")
    ends = np.array([r["t_start"] + r["latency_s"] for r in reqs])
    if len(ends):
        bins = np.arange(0, ends.max() + 2, 2.0)
        counts, _ = np.histogram(ends, bins)
        ax[0].plot(bins[1:], counts / 2.0, label="completed req/s (2 s bins)")
    ax[0].set_ylabel("users, req/s")
    ax[0].legend(loc="upper right")
    deps = sorted({k for s in res["replicas_over_time"] for k in s if k.startswith("Worker-")})
    for d in deps:
        ax[1].step([s["t"] for s in res["replicas_over_time"]], [s.get(d, 0) for s in res["replicas_over_time"]],
                   where="post", label=d)
    ax[1].axvline(res["autoscaling"]["t_load_end_s"], color="grey", ls="--", lw=1, label="load stops")
    ax[1].set_ylabel("running replicas")
    ax[1].legend(loc="upper right")
    ax[2].scatter([r["t_start"] for r in reqs], [r["latency_s"] for r in reqs], s=4, label="latency")
    ax[2].scatter([r["t_start"] for r in reqs if r["ttft_s"]], [r["ttft_s"] for r in reqs if r["ttft_s"]], s=4,
                  label="time to first token")
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("time since start (s)")
    ax[2].legend(loc="upper right")
    o = res["overall"]
    fig.suptitle(f"rankserve load: {res['config']['family']} busy, {o['requests']} requests, "
                 f"{o['outcomes']['lost']} lost; replicas {res['autoscaling']['min_replicas']} -> "
                 f"{res['autoscaling']['peak_replicas']} -> back: {res['autoscaling']['scaled_down']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_stages(text: str) -> list[Stage]:
    """"20:1,60:8,30:2" -> [Stage(20, 1), Stage(60, 8), Stage(30, 2)]  (seconds:users)."""
    try:
        return [Stage(float(d), int(u)) for d, u in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stages look like 20:1,60:8 (seconds:users), got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(prog="rankserve bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=parse_stages, default=parse_stages("20:1,60:8,30:2"), help="seconds:users,...")
    p.add_argument("--config", default=str(ROOT / "configs" / "serve.local.yaml"))
    p.add_argument("--family", default="svd-llm", help="the busy family")
    p.add_argument("--other-share", type=float, default=0.1, help="fraction of requests to the other families")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cooldown", type=float, default=120.0, help="max seconds to wait for the scale-down")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--tag", default="local-cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--family-option", action="append", default=[], metavar="KEY=VALUE",
                   help="set on every family of the config, VALUE read as YAML (e.g. join_running=false); repeatable")
    a = p.parse_args(argv)
    options = {}
    for kv in a.family_option:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            p.error(f"--family-option takes KEY=VALUE, got {kv!r}")
        options[key] = yaml.safe_load(value)
    res = run_load(a.stages, config=a.config, family=a.family, other_share=a.other_share, max_tokens=a.max_tokens,
                   cooldown_max_s=a.cooldown, out_dir=a.out, tag=a.tag, seed=a.seed, family_options=options)
    summary = {k: res[k] for k in ("overall", "autoscaling", "json_path", "png_path")}
    print(json.dumps(summary, indent=1) if a.json else _human(res))
    return 0 if res["overall"]["outcomes"]["lost"] == 0 else 1


def _human(res: dict[str, Any]) -> str:
    o, a = res["overall"], res["autoscaling"]
    lines = [f"{o['requests']} requests: {o['outcomes']}; statuses {o['statuses']}",
             f"latency p50/p90/p99 {o['latency_s']} s; TTFT {o['ttft_s']} s",
             f"throughput {o['throughput_rps']} req/s, {o['throughput_tokens_per_s']} tok/s; "
             f"rank-cache hit rate {o['rank_cache_hit_rate']}; router overhead {o['router_overhead_ms']} ms "
             f"(lookup alone {o['rank_cache_lookup_ms']} ms)",
             f"{a['deployment']}: {a['min_replicas']} -> {a['peak_replicas']} replicas (t={a['t_peak_s']} s), "
             f"load stopped at {a['t_load_end_s']} s, back to {a['min_replicas']} at {a['t_back_to_min_s']} s",
             f"wrote {res['json_path']} and {res.get('png_path')}"]
    for i, s in enumerate(res["stages"]):
        lines.append(f"stage {i} ({s['users']} users, {s['duration_s']:g} s): {s['requests']} req, "
                     f"p50/p99 {s['latency_s']['p50']}/{s['latency_s']['p99']} s, TTFT p50 {s['ttft_s']['p50']} s, "
                     f"{s['throughput_rps']} req/s, lost {s['outcomes']['lost']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
