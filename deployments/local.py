"""The service on one machine: redis-server + a local Ray + Serve, deployed from a Serve config file.

Used by `make run` (scripts/run_demo.py), `rankserve serve`, the integration tests and the load test. The config
goes through Serve's own deploy path (the one `serve run config.yaml` takes), so what runs here is what
`serve deploy` and KubeRay run on a cluster.

    with LocalService("configs/serve.local.yaml") as svc:
        httpx.post(svc.http_url + "/v1/completions", json=...)
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = ROOT / "models" / "stories260K"
# family -> model dir under .cache/models; the static families come from `rankserve compress --method <family>`,
# "parse-svd-llm" from `rankserve train-parse` (PARSE routers over an svd-llm rank-expert pool)
LOCAL_FAMILIES = {"svd-llm": "stories260K-svd-llm-0.8", "basis-sharing": "stories260K-basis-sharing-0.8",
                  "parse-svd-llm": "stories260K-parse-svd-llm-0.8"}
# A quick PARSE build (a few CPU seconds): enough to route and serve, not a trained result (bench/results/parse.md).
# Same calibration text and tokens as the svd-llm family, so its static subset (first K) is exactly that model.
PARSE_BUILD = ["--windows", "192", "--window", "32", "--prompt-len", "16", "--batch-size", "32", "--steps", "50",
               "--kd-steps", "25"]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- models for the local config ----------------------------------------------------------------------------------

def ensure_models(cache_dir: Path = ROOT / ".cache" / "models", keep: float = 0.8, quiet: bool = False) -> dict[str, Path]:
    """Build the local families from the bundled model with `rankserve compress` (static families) or `rankserve
    train-parse` (PARSE) where missing; returns {family: dir}.

    Calibration text (and PARSE's router-training text) is sampled from the bundled model itself (seeded, so
    reproducible): in-distribution for a TinyStories model and needs no data set on disk.
    """
    cache_dir = Path(cache_dir)
    out = {}
    for family, name in LOCAL_FAMILIES.items():
        path = cache_dir / name.replace("0.8", f"{keep:g}")
        if not (path / "model.safetensors").is_file():
            calib = _calibration_text(cache_dir.parent / "calib" / "stories260K-selfgen.txt")
            cli = [sys.executable, "-m", "rankserve.cli"]
            if family.startswith("parse-"):
                cmd = cli + ["train-parse", "--base", family.removeprefix("parse-"), "--keep", str(keep),
                             "--calib-text", str(calib), "--train-text", str(calib), "--calib-tokens", "8192",
                             *PARSE_BUILD, str(BUNDLED_MODEL), str(path), "--json"]
            else:
                cmd = cli + ["compress", "--method", family, "--keep", str(keep), "--calib", str(calib),
                             "--calib-tokens", "8192", str(BUNDLED_MODEL), str(path), "--json"]
            if not quiet:
                print(f"building {path} ({family}, keep {keep}) ...", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
        out[family] = path
    return out


def _calibration_text(path: Path, stories: int = 40, tokens: int = 200) -> Path:
    if path.is_file():
        return path
    from rankserve.workers.engine import Engine
    from rankserve.workers.sampler import SamplingParams

    engine = Engine.load(BUNDLED_MODEL)
    texts = []
    for s in range(0, stories, engine.max_batch_size):
        params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1000 + i)
                  for i in range(s, min(s + engine.max_batch_size, stories))]
        texts += [r.text for r in engine.generate_batch(["Once upon a time"] * len(params), params)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n\n".join("Once upon a time" + t for t in texts) + "\n")
    tmp.replace(path)
    return path


# ---- redis-server ---------------------------------------------------------------------------------------------------

class RedisProcess:
    """A throwaway redis-server (no persistence) in a temp dir."""

    def __init__(self, port: int):
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="rankserve-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisProcess":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: apt-get install -y redis-server (or brew install redis)")
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            if not port_free(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- Ray + Serve ------------------------------------------------------------------------------------------------------

class LocalService:
    """redis-server (when the config's Redis is local and not running) + local Ray + Serve from a config."""

    def __init__(
        self,
        config: str | Path | dict[str, Any] = ROOT / "configs" / "serve.local.yaml",
        num_cpus: int = 8,  # logical CPU slots for Ray (replicas ask for 0.5 each), not cores
        metrics_port: int | None = None,  # Prometheus endpoint of Ray's metrics agent; None = a free port
        start_redis: bool = True,  # start a redis-server if the config's redis_url is local and nothing listens
        ready_timeout_s: float = 300,
    ):
        self.config = copy.deepcopy(config if isinstance(config, dict) else yaml.safe_load(Path(config).read_text()))
        self.num_cpus = num_cpus
        self.metrics_port = metrics_port or free_port()
        self.start_redis = start_redis
        self.ready_timeout_s = ready_timeout_s
        self.redis: RedisProcess | None = None
        (self.app,) = self.config["applications"]

    @property
    def http_url(self) -> str:
        h = self.config.get("http_options", {})
        host = h.get("host", "127.0.0.1")
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{h.get('port', 8000)}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.config.get('grpc_options', {}).get('port', 9000)}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> "LocalService":
        from ray.serve.schema import ServeDeploySchema

        schema = ServeDeploySchema.model_validate(self.config)  # before starting anything: a bad config leaves nothing
        for what, port in (("HTTP", urlparse(self.http_url).port), ("gRPC", int(self.grpc_target.split(":")[1]))):
            if not port_free(port):
                raise RuntimeError(f"{what} port {port} is in use: stop what holds it or change the port in the config")
        try:
            redis_url = self.app["args"].get("redis_url")
            if self.start_redis and redis_url:
                u = urlparse(redis_url)
                if u.hostname in ("127.0.0.1", "localhost") and port_free(u.port or 6379):
                    self.redis = RedisProcess(u.port or 6379).start()
            self._start_ray(schema)
        except BaseException:
            self.stop()  # leave nothing running behind a failed start
            raise
        return self

    def _start_ray(self, schema) -> None:
        import ray
        from ray.serve._private import api as serve_api
        from ray.serve.config import gRPCOptions

        ray.init(num_cpus=self.num_cpus, namespace="serve", include_dashboard=False, log_to_driver=False,
                 _metrics_export_port=self.metrics_port, _system_config={"metrics_report_interval_ms": 1000})
        # What `serve run config.yaml` does: start Serve with the config's proxy options, deploy its applications.
        client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                       proxy_location=schema.proxy_location,
                                       grpc_options=gRPCOptions(**schema.grpc_options.model_dump()))
        client.deploy_apps(schema, _blocking=False)
        self.wait_ready()

    def wait_ready(self) -> None:
        from ray import serve

        name = self.app["name"]
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            st = serve.status().applications.get(name)
            if st is not None and st.status == "RUNNING":
                return
            if st is not None and st.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                # Serve's message ends with the replica's traceback: its last line is the error itself
                details = "; ".join(f"{d}: {s.message.strip().splitlines()[-1]}" for d, s in st.deployments.items()
                                    if s.message)
                raise RuntimeError(f"application {name} failed to deploy: {details or st.message} "
                                   f"(full logs: /tmp/ray/session_latest/logs/serve/)")
            time.sleep(0.5)
        raise TimeoutError(f"application {name} not RUNNING after {self.ready_timeout_s} s")

    def replicas(self) -> dict[str, int]:
        """Running replicas per deployment, from serve.status()."""
        from ray import serve

        st = serve.status().applications[self.app["name"]]
        return {d: s.replica_states.get("RUNNING", 0) for d, s in st.deployments.items()}

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> "LocalService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(config: str | Path, as_json: bool = False) -> None:
    """`rankserve serve`: run the service until Ctrl-C."""
    svc = LocalService(config)
    if svc.app["args"].get("families") and Path(config).resolve() == (ROOT / "configs" / "serve.local.yaml"):
        ensure_models()
    svc.start()
    info = {"http": svc.http_url, "grpc": svc.grpc_target, "metrics": svc.metrics_url,
            "redis": svc.app["args"].get("redis_url"), "app": svc.app["name"]}
    print(json.dumps(info) if as_json else "\n".join(f"{k:8s} {v}" for k, v in info.items()) + "\nCtrl-C to stop",
          flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        svc.stop()
