"""Shortened load test (bench/load.py) against the real local service: under 8 closed-loop users the busy family
scales from 1 replica to >= 2, and back to 1 once the load stops; no request is lost (each one completes or is
refused with a clear status). The full run's figures are in bench/results/load-local-cpu.{json,png}.

Run alone:  .venv/bin/python -m pytest tests/test_autoscale.py -q     (~2-3 min; needs redis-server)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from servers import RedisServer, free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def test_busy_family_scales_up_and_back_down(tmp_path):
    from rankserve.bench.load import Stage, run_load
    from rankserve.deployments.local import LocalService, ensure_models

    models = ensure_models(quiet=True)
    cfg = yaml.safe_load((ROOT / "configs" / "serve.local.yaml").read_text())
    cfg["http_options"]["port"] = free_port()
    cfg["grpc_options"]["port"] = free_port()
    (app,) = cfg["applications"]
    app["args"]["api_key_env"] = None  # this test is about scaling, not auth
    for name, path in models.items():
        app["args"]["families"][name]["model_dir"] = str(path)
    redis = RedisServer(tmp_path).start()
    app["args"]["redis_url"] = redis.url
    svc = LocalService(cfg, start_redis=False)
    try:
        svc.start()
        assert svc.replicas()["Worker-svd-llm"] == 1
        res = run_load([Stage(4, 1), Stage(40, 8)], service=svc, family="svd-llm", other_share=0.1, max_tokens=64,
                       cooldown_max_s=120, out_dir=tmp_path, tag="ci")
    finally:
        svc.stop()
        redis.stop()

    o, a = res["overall"], res["autoscaling"]
    assert o["outcomes"]["lost"] == 0, [r for r in res["requests"] if r["outcome"] == "lost"][:5]
    assert o["outcomes"]["ok"] >= 20
    assert set(o["statuses"]) <= {"200", "408", "429", "503"}
    assert a["peak_replicas"] >= 2, res["replicas_over_time"]
    assert a["scaled_down"] and a["t_back_to_min_s"] > a["t_load_end_s"], res["replicas_over_time"]
    assert o["router_overhead_ms"]["p50"] is not None and o["ttft_s"]["p50"] is not None
    saved = json.loads(Path(res["json_path"]).read_text())
    assert saved["autoscaling"] == a
    assert Path(res["png_path"]).stat().st_size > 10_000
