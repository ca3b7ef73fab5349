"""Worker: one Serve deployment per compression family (`Worker-<family>`), wrapping `workers.Engine`.

One generation runs at a time per replica (the engine holds one model and is not re-entrant); later requests
wait on a FIFO lock, which is the queue Serve's autoscaler sees as ongoing requests. Every engine call runs on
one dedicated thread, one decode step per hop, so the event loop stays free between tokens: a cancelled request
(client gone) stops at the next token, and a request past its deadline ends there too.

Both calls produce the same events (plain dicts, they cross process boundaries):
    {"event": "start", "prompt_tokens", "subset", "cached"}   or   {"event": "error", "status", "message", "param"}
    {"event": "token", "token_id", "text"[, "logprobs"]}         one per generated token; text may be "";
                                                                 "logprobs": the entries of the tokens whose
                                                                 text it releases, when asked for
    {"event": "end", "finish_reason", "completion_tokens"}       "stop" | "length" | "timeout" (request_timeout_s)
`stream` yields them; `generate` returns them folded into one result.
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from rankserve.rank_cache.store import model_version  # the rank-cache namespace, shared with build-rank-cache
from rankserve.workers.chat import read_chat_template

log = logging.getLogger("ray.serve")
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
RATE_BUCKETS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000]


@dataclass
class FamilySpec:
    """One family from the Serve config's `args.families.<name>`."""

    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None = the engine's default for the device
    max_tokens: int = 256  # upper bound on a request's max_tokens
    request_timeout_s: float = 60.0  # from arrival at the replica (queueing included) to the last token
    torch_threads: int | None = None  # None = torch's default (all cores)
    max_batch_size: int = 8
    model_version: str | None = None  # rank-cache namespace; None = derived from the checkpoint's files

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.request_timeout_s <= 0:
            raise ValueError(f"max_tokens and request_timeout_s must be positive: {self}")


DEVICE_ERROR_WORDS = ("CUDA", "CUBLAS", "cuDNN")  # in the messages of torch's RuntimeErrors from the device


def is_device_failure(e: BaseException) -> bool:
    """A CUDA / accelerator error leaves the engine (and its device memory) unusable until the replica restarts;
    any other error (bad numbers in one request, a bug on one input) fails that request only."""
    import torch

    kinds = [torch.cuda.OutOfMemoryError]
    if hasattr(torch, "AcceleratorError"):  # torch >= 2.8 raises it for CUDA errors (a RuntimeError)
        kinds.append(torch.AcceleratorError)
    return isinstance(e, tuple(kinds)) or (isinstance(e, RuntimeError) and any(w in str(e) for w in DEVICE_ERROR_WORDS))


def fold(events: list[dict]) -> dict[str, Any]:
    """Events of one request -> {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", ...}."""
    start, end = events[0], events[-1]
    if start["event"] == "error":
        return start
    tokens = [e for e in events if e["event"] == "token"]
    return dict(event="result", text="".join(e["text"] for e in tokens),
                token_ids=[e["token_id"] for e in tokens][: end["completion_tokens"]],
                logprobs=[l for e in tokens for l in e.get("logprobs", ())],  # empty unless asked for
                prompt_tokens=start["prompt_tokens"], completion_tokens=end["completion_tokens"],
                finish_reason=end["finish_reason"], subset=start["subset"], cached=start["cached"])


@serve.deployment(
    max_ongoing_requests=4,
    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2},
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=30,
)
class Worker:
    """Serves one family. Options (replicas, GPUs) come from the Serve config's `Worker-<family>` entry."""

    def __init__(self, family: str, spec: dict[str, Any]):
        import torch

        from rankserve.workers.engine import Engine

        self.family, self.spec = family, FamilySpec(**spec)
        if self.spec.torch_threads:
            torch.set_num_threads(self.spec.torch_threads)
        dtype = getattr(torch, self.spec.dtype) if self.spec.dtype else None
        self.engine = Engine.load(self.spec.model_dir, device=self.spec.device, dtype=dtype,
                                  max_batch_size=self.spec.max_batch_size)
        self.version = self.spec.model_version or model_version(self.spec.model_dir)
        self.created = int((Path(self.spec.model_dir) / "model.safetensors").stat().st_mtime)  # OpenAI's `created`
        self.stop_ids = set(self.engine.eos)
        self.chat_template = read_chat_template(self.spec.model_dir)  # rendered by the router (chat requests)
        if self.chat_template.error:
            log.warning("%s: chat requests will be refused: %s", family, self.chat_template.error)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{family}")
        self._lock = asyncio.Lock()  # FIFO: one generation at a time
        self._waiting = 0
        self._step_since: float | None = None  # when the running engine call started (health check)
        self._broken: str | None = None

        tags = ("family",)
        self.m_requests = Counter("rankserve_worker_requests", "requests finished by a worker, by outcome",
                                  tag_keys=("family", "outcome"))
        self.m_tokens = Counter("rankserve_generated_tokens", "tokens generated", tag_keys=tags)
        self.m_router_runs = Counter("rankserve_parse_router_runs", "PARSE router runs (rank-cache misses of a "
                                     "PARSE family; a hit skips them)", tag_keys=tags)
        self.m_ttft = Histogram("rankserve_worker_time_to_first_token_seconds",
                                "arrival at the replica to first token (queueing included)", LATENCY_BUCKETS, tags)
        self.m_queue = Histogram("rankserve_worker_queue_seconds", "time waiting for the engine", LATENCY_BUCKETS, tags)
        self.m_rate = Histogram("rankserve_decode_tokens_per_second", "per-request decode speed", RATE_BUCKETS, tags)
        self.m_waiting = Gauge("rankserve_worker_requests_waiting", "requests queued for the engine", tags)
        self.m_running = Gauge("rankserve_worker_requests_running", "requests generating", tags)
        for g in (self.m_waiting, self.m_running):
            g.set(0, tags={"family": family})

    # ---- Serve hooks ----------------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise (Serve restarts the replica after 3 failures) if the engine broke or a step hangs."""
        if self._broken:
            raise RuntimeError(f"engine failed: {self._broken}")
        if self._step_since is not None and time.monotonic() - self._step_since > self.spec.request_timeout_s:
            raise RuntimeError(f"an engine step has been running for over {self.spec.request_timeout_s} s")

    def info(self) -> dict[str, Any]:
        return dict(family=self.family, model_version=self.version, max_seq_len=self.engine.max_seq_len,
                    max_tokens=self.spec.max_tokens, created=self.created,
                    chat_template=dataclasses.asdict(self.chat_template))

    # ---- the two request paths --------------------------------------------------------------------------------

    async def generate(self, prompt: str, sampling: dict[str, Any], cached: bool, subset: dict | None) -> dict:
        async with contextlib.aclosing(self._run(prompt, sampling, cached, subset)) as events:
            return fold([ev async for ev in events])

    async def stream(self, prompt: str, sampling: dict[str, Any], cached: bool,
                     subset: dict | None) -> AsyncIterator[dict]:
        async with contextlib.aclosing(self._run(prompt, sampling, cached, subset)) as events:  # closed with us
            async for ev in events:
                yield ev

    # ---- the loop --------------------------------------------------------------------------------------------

    async def _call(self, fn, *args):
        """Run one engine call on the engine thread; the event loop stays free meanwhile."""
        self._step_since = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        finally:
            self._step_since = None

    async def _run(self, prompt: str, sampling: dict[str, Any], cached: bool,
                   subset: dict | None) -> AsyncIterator[dict]:
        from rankserve.workers.sampler import SamplingParams

        t0 = time.monotonic()
        deadline = t0 + self.spec.request_timeout_s
        tags = {"family": self.family}
        param = None
        try:  # the router validated already; these are the checks that need the model (and a guard)
            params = SamplingParams(**sampling)
            param = "max_tokens"
            if params.max_new_tokens > self.spec.max_tokens:
                raise ValueError(f"max_tokens: {params.max_new_tokens} is above this model's limit of {self.spec.max_tokens}")
            param = "prompt"
            n_prompt = len(self.engine.encode_prompt(prompt, params))  # raises if the prompt overflows the context
        except ValueError as e:
            self.m_requests.inc(tags={**tags, "outcome": "invalid"})
            yield dict(event="error", status=400, message=str(e), param=param)
            return

        self._waiting += 1
        self.m_waiting.set(self._waiting, tags=tags)
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                await self._lock.acquire()
        except TimeoutError:
            self.m_requests.inc(tags={**tags, "outcome": "timeout"})
            yield dict(event="error", status=408, param=None, message=f"no free {self.family} replica within "
                                                                      f"{self.spec.request_timeout_s:g} s; retry later")
            return
        finally:
            self._waiting -= 1
            self.m_waiting.set(self._waiting, tags=tags)

        gen, outcome, n = None, "cancelled", 0
        self.m_running.set(1, tags=tags)
        self.m_queue.observe(time.monotonic() - t0, tags=tags)
        try:
            if not cached:  # a miss: the model's own routers choose (None = static ranks); the router writes it back
                subset = await self._call(self.engine.rank_subset, prompt)
                if subset is not None:  # None: a static family, no routers ran
                    self.m_router_runs.inc(tags=tags)
            yield dict(event="start", prompt_tokens=n_prompt, subset=subset, cached=cached)
            gen = self.engine.stream(prompt, params, subset=subset)
            t_first = None
            finish = None
            while finish is None:
                if time.monotonic() > deadline:
                    finish = "timeout"
                    break
                ev = await self._call(next, gen, None)
                if ev is None:  # the engine ended without a reason: count it as length
                    finish = "length"
                    break
                if t_first is None:
                    t_first = time.monotonic()
                    self.m_ttft.observe(t_first - t0, tags=tags)
                finish = ev.finish_reason
                if not (finish == "stop" and ev.token_id in self.stop_ids | set(params.stop_token_ids)):
                    n += 1  # a stop token ends the text but is not part of it
                token = dict(event="token", token_id=ev.token_id, text=ev.text)
                if ev.logprobs:  # {"token", "logprob", "bytes", "offset", "top": [(text, logprob, bytes)]}
                    token["logprobs"] = [dataclasses.asdict(l) for l in ev.logprobs]
                yield token
            if t_first is not None and n > 1:
                self.m_rate.observe((n - 1) / max(time.monotonic() - t_first, 1e-9), tags=tags)
            outcome = finish
            yield dict(event="end", finish_reason=finish, completion_tokens=n)
        except Exception as e:  # fails this request (the router answers 500); CancelledError is not an Exception
            outcome = "error"
            if is_device_failure(e):  # fail health checks: Serve replaces the replica
                self._broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            if gen is not None:  # close the engine's generator on its own thread, queued after any step in flight;
                self._thread.submit(gen.close)  # the next request's steps queue behind it, so no wait is needed
            self._lock.release()
            self.m_running.set(0, tags=tags)
            if n:
                self.m_tokens.inc(n, tags=tags)
            self.m_requests.inc(tags={**tags, "outcome": outcome})
