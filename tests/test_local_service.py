"""LocalService.start on a config Serve refuses: it fails before starting anything, so no redis-server is left
behind. Fast: validation fails before Ray starts.

Run alone:  .venv/bin/python -m pytest tests/test_local_service.py -q     (needs redis-server on PATH)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rankserve.deployments.local import LocalService, port_free
from servers import free_port

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parents[1]


def test_invalid_config_starts_no_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    cfg = yaml.safe_load((ROOT / "configs" / "serve.local.yaml").read_text())
    cfg["http_options"]["port"], cfg["grpc_options"]["port"] = free_port(), free_port()
    (app,) = cfg["applications"]
    redis_port = free_port()
    app["args"]["redis_url"] = f"redis://127.0.0.1:{redis_port}/0"  # local and free: start() would launch one
    app["deployments"][0]["num_replicas"] = "lots"
    svc = LocalService(cfg)
    try:
        with pytest.raises(ValidationError, match="num_replicas"):
            svc.start()
        assert svc.redis is None and port_free(redis_port), "a failed start left redis-server running"
    finally:
        if svc.redis is not None:
            svc.redis.stop()
