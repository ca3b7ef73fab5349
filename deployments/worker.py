"""Worker: one Serve deployment per compression family (`Worker-<family>`), wrapping `workers.Engine`.

Requests decode in batches: a replica's batch loop takes up to `max_batch_size` waiting requests (FIFO) and
decodes them together (`Engine.stream_batch`), one step for every row at a time. Requests that arrive meanwhile
join the running batch between steps while it has room (continuous batching; `join_running=False`: they wait for
the next batch), and a row that finishes frees its place at once. Waiting and running requests are what Serve's
autoscaler sees as ongoing requests. Every engine call runs on one dedicated thread, one decode step per hop, so
the event loop stays free between tokens: a cancelled request (client gone) leaves its batch at the next step,
and a request past its deadline ends there too; the other rows go on.

Both calls produce the same events (plain dicts, they cross process boundaries):
    {"event": "start", "prompt_tokens", "subset", "cached", "cache_rejected"[, "prompt_logprobs"]}
                                                  or   {"event": "error", "status", "message", "param"}
        "cached": the request runs the router's cached subset; "cache_rejected": it brought one this model refuses
        (fails its routers' checks), so its own routers chose `subset` instead
    {"event": "token", "token_id", "text"[, "logprobs"]}         one per generated token; text may be "";
                                                                 "logprobs": the entries of the tokens whose
                                                                 text it releases, when asked for
    {"event": "end", "finish_reason", "completion_tokens"}       "stop" | "length" | "timeout" (request_timeout_s)
`stream` yields them; `generate` returns them folded into one result.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
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
BATCH_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16]
RATE_BUCKETS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000]
INLINE_TOKENIZE_CHARS = 20_000  # longer prompt texts tokenize on a thread (~6 ms and up), shorter ones inline


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
    batch_wait_ms: float = 5.0  # how long the batch loop waits for more requests before starting a partial batch
    # (a lone request's first token comes that much later; 0: off). Measured: bench/results/worker-batching-cpu-jitter.md
    join_running: bool = True  # requests join a running batch between steps (continuous batching); False: static
    # batches, each decoded to its end while new requests wait (measured against: worker-batching-cpu-continuous.md)
    join_min_rows: int | None = None  # free places a running batch needs before waiting requests join; None: the
    # engine's default (1; a PARSE family on the GPU: max_batch_size // 2, measured in parse-joins-h200.md)
    prefill_chunk: int | None = None  # a longer prompt joins a decoding batch this many tokens a step, so the running
    # rows keep making tokens while it fills (0: whole prompts). None: the engine's default, 512 (a PARSE family on
    # the GPU: 0). Measured in bench/results/chunked-prefill-h200.md, parse-joins-h200.md
    prefix_cache_gb: float | None = None  # earlier prompts' K/V kept so a prompt that starts alike (a chat's system
    # prompt and history) prefills only the rest (workers/prefix_cache.py; static models). None: the engine's default
    # (5 % of the GPU's memory, 256 MB on the CPU); 0: off
    decoder_memory_gb: float | None = None  # what the GPU fast path's decoders may hold (KV caches of each batch-size
    # and context bucket, PARSE slot weights); least recently used dropped first. None: 40 % of the GPU's memory.
    # The graphed and chunked prefills' one-row caches and graph memory pools (workers/prefill_graph.py) count
    # against it once built; the prefix cache (prefix_cache_gb) does not
    model_version: str | None = None  # rank-cache namespace; None = derived from the checkpoint's files

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.request_timeout_s <= 0:
            raise ValueError(f"max_tokens and request_timeout_s must be positive: {self}")
        if self.max_batch_size <= 0 or (self.decoder_memory_gb is not None and self.decoder_memory_gb <= 0):
            raise ValueError(f"max_batch_size and decoder_memory_gb must be positive: {self}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0: {self}")
        if self.join_min_rows is not None and not 1 <= self.join_min_rows <= self.max_batch_size:
            raise ValueError(f"join_min_rows must be in 1..max_batch_size: {self}")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts): {self}")
        if self.prefix_cache_gb is not None and self.prefix_cache_gb < 0:
            raise ValueError(f"prefix_cache_gb must be >= 0 (0: off): {self}")


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
                finish_reason=end["finish_reason"], subset=start["subset"], cached=start["cached"],
                cache_rejected=start["cache_rejected"],
                prompt_logprobs=start.get("prompt_logprobs"))  # with echo + logprobs


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
        gb = self.spec.decoder_memory_gb
        self.engine = Engine.load(self.spec.model_dir, device=self.spec.device, dtype=dtype,
                                  max_batch_size=self.spec.max_batch_size,
                                  decoder_memory_bytes=None if gb is None else int(gb * 2**30),
                                  prefill_chunk=self.spec.prefill_chunk,
                                  prefix_cache_bytes=None if self.spec.prefix_cache_gb is None else
                                  int(self.spec.prefix_cache_gb * 2**30))
        if self.spec.join_min_rows is not None:
            self.engine.join_min = self.spec.join_min_rows
        self.version = self.spec.model_version or model_version(self.spec.model_dir)
        self.created = int((Path(self.spec.model_dir) / "model.safetensors").stat().st_mtime)  # OpenAI's `created`
        self.stop_ids = set(self.engine.eos)
        self.chat_template = read_chat_template(self.spec.model_dir)  # rendered by the router (chat requests)
        if self.chat_template.error:
            log.warning("%s: chat requests will be refused: %s", family, self.chat_template.error)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{family}")
        self._pending: collections.deque[_Pending] = collections.deque()  # FIFO, not yet in a batch
        self._wake = asyncio.Event()
        self._batcher: asyncio.Task | None = None  # the batch loop, started by the first request
        self._running: list[_Pending] = []  # the batch being decoded
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
        self.m_batch_rows = Histogram("rankserve_worker_batch_rows", "rows per decode step", BATCH_BUCKETS, tags)
        self.m_prefix = Counter("rankserve_prefix_cache_hit_tokens", "prompt tokens whose K/V came from the prefix "
                                "cache instead of a prefill", tag_keys=tags)
        self._prefix_seen = 0  # the engine's prefix-cache hit tokens already counted
        self.m_waiting = Gauge("rankserve_worker_requests_waiting", "requests queued for the engine", tags)
        self.m_running = Gauge("rankserve_worker_requests_running", "requests generating (the batch's size)", tags)
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

    async def detokenize(self, ids: list[int]) -> dict[str, Any]:
        """The text of a prompt sent as token ids (the router embeds it for the rank cache and echoes it): {"text"},
        or an error event (400) naming the first id that is not a token of this model."""
        try:
            return dict(text=await asyncio.to_thread(self.engine.decode_prompt, ids))
        except ValueError as e:
            return dict(event="error", status=400, message=f"prompt: {e}", param="prompt")

    # ---- the two request paths --------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], sampling: dict[str, Any], cached: bool, subset: dict | None,
                       echo: bool = False) -> dict:
        """`prompt`: a text, or token ids used as given (no BOS added). `echo` with logprobs: the start event (and
        the result) also carry the prompt's own entries; with max_new_tokens 0 nothing is generated (the prompt is
        only scored)."""
        async with contextlib.aclosing(self._run(prompt, sampling, cached, subset, echo)) as events:
            return fold([ev async for ev in events])

    async def stream(self, prompt: str | list[int], sampling: dict[str, Any], cached: bool,
                     subset: dict | None, echo: bool = False) -> AsyncIterator[dict]:
        """`echo` with logprobs: the start event carries the prompt's own entries, as `generate`'s."""
        async with contextlib.aclosing(self._run(prompt, sampling, cached, subset, echo)) as events:  # closed with us
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

    async def _run(self, prompt: str | list[int], sampling: dict[str, Any], cached: bool,
                   subset: dict | None, echo: bool = False) -> AsyncIterator[dict]:
        """One request: check it, queue it for a batch, pass on the events the batch loop gives it."""
        from rankserve.workers.sampler import SamplingParams

        t0 = time.monotonic()
        tags = {"family": self.family}
        score_only = echo and sampling.get("max_new_tokens") == 0  # echo of a prompt, nothing generated
        param = "max_tokens" if sampling.get("max_new_tokens", 1) <= 0 and not score_only else None
        try:  # the router validated already; these are the checks that need the model (and a guard)
            params = SamplingParams(**{**sampling, "max_new_tokens": 1} if score_only else sampling)
            param = "max_tokens"
            if params.max_new_tokens > self.spec.max_tokens:
                raise ValueError(f"max_tokens: {params.max_new_tokens} is above this model's limit of {self.spec.max_tokens}")
            param = "prompt"
            # raises if the prompt overflows the context or the tokenizer can't read it. A long text tokenizes on a
            # thread (~0.3 s for 1 M characters) while the event loop serves the replica's other streams; a short one
            # here, so requests queue in the order they came (a thread may finish them in another)
            long = isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS
            n_prompt = len(await asyncio.to_thread(self.engine.encode_prompt, prompt, params) if long
                           else self.engine.encode_prompt(prompt, params))
        except ValueError as e:
            self.m_requests.inc(tags={**tags, "outcome": "invalid"})
            yield dict(event="error", status=400, message=str(e), param=param)
            return

        if self.engine.routers is None:
            subset = None  # a static family takes none
        req = _Pending(prompt, params, n_prompt, cached, subset, t0, t0 + self.spec.request_timeout_s,
                       echo=echo and params.logprobs is not None, score_only=score_only)
        self._pending.append(req)
        self._set_waiting()
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.done() or self._batcher.get_loop() is not loop:
            self._wake = asyncio.Event()  # the first request (or a new event loop, in tests)
            self._batcher = loop.create_task(self._batches())
            self._batcher.add_done_callback(self._batcher_ended)
        self._wake.set()
        try:
            while True:
                try:  # a queued request waits until its deadline; a running one, for the batch loop
                    timeout = None if req.started else max(req.deadline - time.monotonic(), 0)
                    ev = await asyncio.wait_for(req.events.get(), timeout)
                except TimeoutError:
                    if req.started:
                        continue
                    self.m_requests.inc(tags={**tags, "outcome": "timeout"})
                    yield dict(event="error", status=408, param=None, message=f"no free {self.family} replica within "
                                                                              f"{self.spec.request_timeout_s:g} s; retry later")
                    return
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev["event"] == "end":
                    return
        finally:
            req.cancelled = True  # the client went away, or we are done: the batch loop drops the row
            if req in self._pending:
                self._pending.remove(req)
                self._set_waiting()

    def _check_subset(self, subset: dict | None) -> dict | None:
        """A rank-cache subset, checked on the engine thread before it joins a batch (one bad row would fail them
        all; a 7B subset holds ~330 K indices); None if this model can't take it, to route the request afresh."""
        from rankserve.workers.parse import validate

        try:
            return validate(subset, self.engine.routers)
        except ValueError as e:
            log.warning("%s: ignoring a rank-cache subset (%s); routing the request afresh", self.family, e)
            return None

    def _batcher_ended(self, task: asyncio.Task) -> None:
        """The batch loop never returns; if it ends anyway (cancelled, a bug), no request may wait on it forever:
        every unfinished one fails (the router answers 500)."""
        for req in [*self._running, *self._pending]:
            if req.finish is None:
                req.finish = "error"
                req.events.put_nowait(RuntimeError(f"the {self.family} replica's batch loop stopped"))
        self._pending.clear()
        self._running = []
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the batch loop failed", self.family, exc_info=task.exception())

    def _set_waiting(self) -> None:
        self.m_waiting.set(len(self._pending), tags={"family": self.family})

    async def _batches(self) -> None:
        """The batch loop: while requests wait, take up to max_batch_size of them (FIFO) and decode them together;
        requests that arrive meanwhile join between steps (`join_running`) or wait for the next batch."""
        while True:
            if 0 < len(self._pending) < self.engine.max_batch_size and self.spec.batch_wait_ms > 0:
                # a short wait for more: requests rarely arrive together (clients of the last batch come back one
                # by one), and each joining row costs the running rows a prefill
                await asyncio.sleep(self.spec.batch_wait_ms / 1e3)
            batch = self._take(self.engine.max_batch_size)
            if batch:
                await self._run_batch(batch)
            elif not self._pending:
                self._wake.clear()
                await self._wake.wait()

    def _take(self, n: int) -> list["_Pending"]:
        """Up to n waiting requests, FIFO, marked started (the cancelled and expired are their consumers' to
        answer)."""
        batch: list[_Pending] = []
        while self._pending and len(batch) < n:
            req = self._pending.popleft()
            if not req.cancelled and time.monotonic() < req.deadline:
                req.started = True
                batch.append(req)
        self._set_waiting()
        self._running.extend(batch)  # until they end: what _batcher_ended fails if the loop dies meanwhile
        return batch

    async def _run_batch(self, first: list["_Pending"]) -> None:
        """Decode a batch to its end, admitting waiting requests between steps; never raises (a failure goes to
        the requests it hits)."""
        tags = {"family": self.family}
        stream = None
        live: dict[int, _Pending] = {}  # the batch's row number -> its request
        routed: dict[str | tuple, dict | None] = {}  # _key(prompt) -> the routers' subset while one of its rows
        # runs: a prompt's n choices route once
        try:
            stream = await self._call(self.engine.stream_batch, [], [], [], True)
            joining = first
            while True:
                if joining:
                    await self._admit(stream, joining, live, routed)
                now = time.monotonic()
                for i, req in live.items():  # between steps: rows whose client left or whose time is up
                    if req.finish is None and req.cancelled:
                        stream.stop(i, "cancelled")
                        self._end(req, "cancelled")
                    elif req.finish is None and now > req.deadline:
                        stream.stop(i, "timeout")
                        self._end(req, "timeout")
                live = {i: r for i, r in live.items() if r.finish is None}
                self._running = [r for r in self._running if r.finish is None]
                self.m_running.set(len(live), tags=tags)
                if not live:
                    if self.spec.join_running and self._pending:  # the batch emptied as others arrived
                        joining = self._take(stream.room())
                        continue
                    break
                self.m_batch_rows.observe(len(live), tags=tags)
                step = await self._call(next, stream, None)
                if step is None:  # the engine ended without a reason: count it as length
                    for req in live.values():
                        self._end(req, "length")
                    break
                for i, ev in step.items():
                    if live[i].finish is None:
                        self._token(live[i], ev)
                if self.engine.prefix is not None and self.engine.prefix.hit_tokens > self._prefix_seen:
                    self.m_prefix.inc(self.engine.prefix.hit_tokens - self._prefix_seen, tags=tags)
                    self._prefix_seen = self.engine.prefix.hit_tokens
                # continuous batching: waiting requests take the places free for the next step
                joining = (self._take(stream.admits(len(self._pending))) if self.spec.join_running and self._pending
                           else [])
        except Exception as e:  # a failed step fails the batch's unfinished requests; CancelledError passes
            for req in self._running:
                if req.finish is None:
                    self._fail(req, e)
        finally:
            if stream is not None:  # closed on the engine thread, queued behind any step in flight
                self._thread.submit(stream.close)
            self._running = []
            self.m_running.set(0, tags=tags)

    async def _admit(self, stream, reqs: list["_Pending"], live: dict[int, "_Pending"],
                     routed: dict[str | tuple, dict | None]) -> None:
        """Prepare each request on the engine thread (check a cached subset or route a miss, score an echoed
        prompt), send its start event and add it to the batch; a failure fails that request only."""
        tags = {"family": self.family}
        running = {_key(r.prompt) for r in live.values() if r.finish is None}
        for p in [p for p in routed if p not in running]:  # a batch may run for ever: keep only live prompts'
            del routed[p]
        for req in reqs:
            self.m_queue.observe(time.monotonic() - req.t0, tags=tags)
            try:
                rejected = False  # a cached subset this model refuses: the router counts a miss and drops the entry
                if req.cached and self.engine.routers is not None:
                    req.subset = await self._call(self._check_subset, req.subset)
                    req.cached = req.subset is not None
                    rejected = not req.cached
                key = _key(req.prompt)
                if not req.cached and key in routed:
                    req.subset = routed[key]
                elif not req.cached:  # a miss: the model's own routers choose (None = static ranks)
                    req.subset = routed[key] = await self._call(self.engine.rank_subset, req.prompt)
                    if req.subset is not None:  # None: a static family, no routers ran
                        self.m_router_runs.inc(tags=tags)
                start = dict(event="start", prompt_tokens=req.n_prompt, subset=req.subset, cached=req.cached,
                             cache_rejected=rejected)
                if req.echo:  # the prompt's own logprobs, scored with the request's subset
                    scored = await self._call(self.engine.prompt_logprobs, req.prompt, req.params.logprobs,
                                              req.subset)
                    start["prompt_logprobs"] = [dataclasses.asdict(l) for l in scored]
                i = None if req.score_only else await self._call(stream.add, req.prompt, req.params, req.subset, True)
            except Exception as e:
                self._fail(req, e)
                continue
            req.events.put_nowait(start)
            if req.score_only:
                self._end(req, "length")
            else:
                live[i] = req

    def _token(self, req: "_Pending", ev) -> None:
        now = time.monotonic()
        tags = {"family": self.family}
        if req.t_first is None:
            req.t_first = now
            self.m_ttft.observe(now - req.t0, tags=tags)
        if not (ev.finish_reason == "stop" and ev.token_id in self.stop_ids | set(req.params.stop_token_ids)):
            req.n += 1  # a stop token ends the text but is not part of it
        token = dict(event="token", token_id=ev.token_id, text=ev.text)
        if ev.logprobs:  # {"token", "logprob", "bytes", "offset", "top": [(text, logprob, bytes)]}
            token["logprobs"] = [dataclasses.asdict(l) for l in ev.logprobs]
        req.events.put_nowait(token)
        if ev.finish_reason is not None:
            self._end(req, ev.finish_reason)

    def _end(self, req: "_Pending", finish: str) -> None:
        tags = {"family": self.family}
        req.finish = finish
        if req.t_first is not None and req.n > 1 and finish != "cancelled":
            self.m_rate.observe((req.n - 1) / max(time.monotonic() - req.t_first, 1e-9), tags=tags)
        if req.n:
            self.m_tokens.inc(req.n, tags=tags)
        self.m_requests.inc(tags={**tags, "outcome": finish})
        req.events.put_nowait(dict(event="end", finish_reason=finish, completion_tokens=req.n))

    def _fail(self, req: "_Pending", e: Exception) -> None:
        """The request fails with `e` (the router answers 500); a device error also fails health checks."""
        if is_device_failure(e):  # Serve replaces the replica
            self._broken = f"{type(e).__name__}: {e}"
        req.finish = "error"
        self.m_requests.inc(tags={"family": self.family, "outcome": "error"})
        req.events.put_nowait(e)


def _key(prompt: str | list[int]) -> str | tuple[int, ...]:
    """A prompt as a dict key (token ids as a tuple)."""
    return prompt if isinstance(prompt, str) else tuple(prompt)


@dataclass(eq=False)
class _Pending:
    """One request inside a replica: what it asked for, and the queue its events go through."""

    prompt: str | list[int]  # a text, or token ids
    params: Any  # SamplingParams
    n_prompt: int
    cached: bool
    subset: dict | None
    t0: float  # arrival (monotonic)
    deadline: float
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    started: bool = False  # taken into a batch
    cancelled: bool = False  # its consumer is gone
    finish: str | None = None  # set once its end (or error) is queued
    n: int = 0  # completion tokens (a stop token not counted)
    t_first: float | None = None
    echo: bool = False  # the start event carries the prompt's logprobs
    score_only: bool = False  # nothing to generate (echo with max_tokens 0)
