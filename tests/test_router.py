"""The Router's own logic with fake workers (no Ray cluster, no MiniLM): /readyz asks every family's worker each
time (a worker that died after answering once must show), a stuck worker counts as not ready after ready_timeout_s,
/v1/models carries OpenAI's `created`, and there is no /openapi.json to reach without a key.

Run alone:  .venv/bin/python -m pytest tests/test_router.py -q
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from rankserve.deployments import router as router_mod
from rankserve.deployments.auth import ApiKeys
from rankserve.deployments.schemas import FamilyLimits

# Serve's ingress wrapper has an async __del__, never awaited for these bare instances: harmless here
pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:coroutine .*__del__. was never awaited")]
CREATED = 1_700_000_000


class FakeCall:
    """What `handle.method.remote()` returns: awaitable, cancellable."""

    def __init__(self, coro):
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.task.cancel()


class FakeWorker:
    """A Worker deployment handle whose `info` answers, fails (a dead replica) or never answers (a stuck one)."""

    def __init__(self, family: str):
        self.family, self.state, self.asked = family, "up", 0
        self.info = SimpleNamespace(remote=lambda: FakeCall(self._info()))

    async def _info(self):
        self.asked += 1
        if self.state == "dead":
            raise RayActorError()
        if self.state == "stuck":
            await asyncio.sleep(3600)
        return dict(family=self.family, model_version=f"{self.family}-v1", max_seq_len=512, max_tokens=64,
                    created=CREATED, chat_template=dict(source=None, bos_token="", eos_token=""))


def make_router(families=("svd-llm", "basis-sharing")):
    """A Router instance without its __init__ (which loads MiniLM): only what readyz and models use."""
    cls = router_mod.Router.func_or_class
    r = cls.__new__(cls)
    r.workers = {f: FakeWorker(f) for f in families}
    r.limits = {f: FamilyLimits(max_tokens=64) for f in families}
    r.keys, r.cache, r.ready_timeout_s = ApiKeys(), None, 5.0
    r.versions, r.created, r.templates, r.started = {}, {}, {}, int(time.time())
    r._versions_locks = {f: asyncio.Lock() for f in families}
    return r


def readyz(r) -> tuple[int, dict]:
    resp = asyncio.run(r.readyz())
    return resp.status_code, json.loads(resp.body)


def test_readyz_asks_every_time():
    r = make_router()
    assert readyz(r)[0] == 200
    assert r.versions == {"svd-llm": "svd-llm-v1", "basis-sharing": "basis-sharing-v1"}
    asked = r.workers["svd-llm"].asked

    r.workers["svd-llm"].state = "dead"  # answered once, then died: readiness must not rely on the first answer
    status, body = readyz(r)
    assert status == 503 and body["status"] == "unavailable"
    assert body["unavailable"] == ["svd-llm: RayActorError"]
    assert r.workers["svd-llm"].asked == asked + 1

    r.workers["svd-llm"].state = "up"
    assert readyz(r)[0] == 200


def test_readyz_gives_up_on_a_stuck_worker():
    r = make_router()
    r.ready_timeout_s = 0.2
    r.workers["basis-sharing"].state = "stuck"
    t0 = time.monotonic()
    status, body = readyz(r)
    assert status == 503 and body["unavailable"] == ["basis-sharing: TimeoutError"]
    assert time.monotonic() - t0 < 2  # families are asked together, each within the timeout


def test_models_carry_created():
    r = make_router()
    request = SimpleNamespace(headers={})
    before = asyncio.run(r.models(request))["data"]  # no worker asked yet: the router's start time
    assert [m["created"] for m in before] == [r.started] * 2
    assert readyz(r)[0] == 200
    after = asyncio.run(r.models(request))["data"]
    assert all(m["created"] == CREATED and m["object"] == "model" for m in after)


def test_no_openapi_schema_to_reach_without_a_key():
    from fastapi.testclient import TestClient

    client = TestClient(router_mod.api)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 404, path
