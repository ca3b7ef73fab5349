"""Router: the ingress. HTTP (OpenAI-shaped, FastAPI) and gRPC (`rankserve.Generator`) on one class.

Per request: auth -> parse + validate (schemas.py, shared by both protocols) -> embed the prompt (MiniLM, batched
across concurrent requests) -> rank-cache lookup for the family's model version -> the family's Worker, with the
cached rank subset or none (a miss: the worker's own choice comes back and is written to the cache; a cached subset
the worker refuses counts as a miss and leaves the cache).

HTTP:  POST /v1/completions and /v1/chat/completions (SSE when "stream": true), GET /v1/models, GET /healthz
       (liveness), GET /readyz. A chat request's messages are rendered by the family's chat template (the
       checkpoint's own, or a plain transcript: workers/chat.py) into a completion request; from there both
       take the same path.
gRPC:  Generate, GenerateStream, Chat, ChatStream (port from the Serve config's grpc_options); the same fields,
       defaults and logprobs as HTTP
Status mapping, both protocols: bad input 400 / INVALID_ARGUMENT, key 401 / UNAUTHENTICATED, deadline 408 /
DEADLINE_EXCEEDED, queue full or replica lost 503 / UNAVAILABLE; only our own bugs give 500 / INTERNAL.
"""

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter, Gauge, Histogram

from rankserve.deployments.auth import ApiKeys
from rankserve.deployments.schemas import (ChatRequest, Choice, CompletionRequest, FamilyLimits, RequestError,
                                           chat_chunk_body, chat_completion_body, chat_logprobs, check_request,
                                           chunk_body, completion_body, completion_logprobs, error_body, from_proto,
                                           new_id, parse_request, usage, usage_chunk_body)
from rankserve.deployments.worker import LATENCY_BUCKETS
from rankserve.proto import rankserve_pb2 as pb
from rankserve.rank_cache import Embedder, Hit, RankCache
from rankserve.workers.chat import ChatTemplate

log = logging.getLogger("ray.serve")
# No /openapi.json or /docs: they would answer without the API key; proto/rankserve.proto and the README are the API.
api = FastAPI(title="rankserve", openapi_url=None, docs_url=None, redoc_url=None)
RENDER_INLINE_CHARS = 100_000  # chat templates render on the event loop below this many message characters (about
# 1 ms measured for 200 K characters, 16 ms for 1 M with the plain transcript); longer ones on a thread
OVERHEAD_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1]
GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
             408: grpc.StatusCode.DEADLINE_EXCEEDED, 503: grpc.StatusCode.UNAVAILABLE, 500: grpc.StatusCode.INTERNAL}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 408: "timeout", 503: "unavailable",
              500: "internal_error"}


class Failure(Exception):
    """A request that ends with an error status (HTTP code; the gRPC code follows from GRPC_CODE)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message, param)  # args == the constructor's: it pickles across Ray processes
        self.status, self.message, self.param = status, message, param

    def __str__(self) -> str:
        return self.message


@dataclass
class Routed:
    """A validated request with its rank-cache outcome."""

    req: CompletionRequest
    version: str  # the family's model version (rank-cache namespace)
    vec: np.ndarray  # (384,) prompt embedding
    hit: Hit | None
    overhead_s: float  # embed + cache lookup
    lookup_s: float  # cache lookup alone
    chat: bool = False  # came in as a chat request: answered in chat shapes
    write_back: bool = True  # a miss writes the worker's subset back (the first choice of its prompt only)
    text: str = ""  # the prompt's text: req.prompt, or its token ids decoded by the family's tokenizer (echo, embedding)


# Helpers sit above the class: @serve.ingress pickles the FastAPI routes by value while the module is still
# being executed, so names defined below the class would be missing inside the routes.
def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _logprobs(routed: Routed, entries: list[dict], prompt: bool = False) -> dict | None:
    """The worker's logprob entries in the request's shape (chat or completion); None when not asked for. With
    echo, a stream's completion entries' offsets move past the prompt; `prompt`: these are the prompt's own."""
    if routed.req.logprobs is None:
        return None
    if routed.chat:
        return chat_logprobs(entries)
    return completion_logprobs(entries, None, len(routed.text) if routed.req.echo and not prompt else 0)


def _cache_headers(routed: list[Routed]) -> dict[str, str]:
    """Each prompt's rank-cache outcome (as its worker took it) and the router's overhead, as response headers."""
    prompts = [r for r in routed if r.write_back]  # one per prompt
    return {"x-rankserve-rank-cache": ",".join("hit" if r.hit else "miss" for r in prompts),
            "x-rankserve-overhead-ms": f"{max(r.overhead_s for r in prompts) * 1e3:.3f}",
            "x-rankserve-lookup-ms": f"{max(r.lookup_s for r in prompts) * 1e3:.3f}"}


def _embed_each(embedder: Embedder, prompts: list[str]) -> list[np.ndarray | Exception]:
    """Each prompt's (384,) embedding alone, or the exception embedding it raised: after a batch failed, so that
    only the prompt that broke it fails."""
    out: list[np.ndarray | Exception] = []
    for p in prompts:
        try:
            out.append(embedder.embed([p])[0])
        except Exception as e:
            out.append(e)
    return out


def _proto_logprobs(entries: list[dict], prompt_entries: list[dict] | None = None,
                    prompt_chars: int = 0) -> list[pb.TokenLogprob]:
    """The worker's logprob entries as `rankserve.TokenLogprob` messages (empty when none were asked for); with
    echo the prompt's entries come first and the completion's offsets move past the prompt's `prompt_chars`."""
    both = [*(prompt_entries or ()), *({**e, "offset": e["offset"] + prompt_chars} for e in entries)]
    return [pb.TokenLogprob(token=e["token"], bytes=bytes(e["bytes"]), text_offset=e["offset"],
                            **({} if e["logprob"] is None else {"logprob": e["logprob"]}),
                            top_logprobs=[pb.TopLogprob(token=t, logprob=lp, bytes=bytes(b)) for t, lp, b in e["top"]])
            for e in both]


def _from_proto(msg, stream: bool = False) -> dict[str, Any]:
    """schemas.from_proto, its RequestError as a 400 Failure (INVALID_ARGUMENT)."""
    try:
        return from_proto(msg, stream)
    except RequestError as e:
        raise Failure(400, e.message, e.param) from None


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(choice, event) from several choices' event streams as they come; closing this stops and closes them all
    (a client gone, or another choice failed: their workers stop at the next token)."""
    nexts = {i: asyncio.ensure_future(anext(s)) for i, s in enumerate(streams)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in [i for i, f in nexts.items() if f in done]:
                try:
                    ev = nexts.pop(i).result()
                except StopAsyncIteration:
                    continue
                nexts[i] = asyncio.ensure_future(anext(streams[i]))
                yield i, ev
    finally:
        for f in nexts.values():
            f.cancel()
        await asyncio.gather(*nexts.values(), return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _gather_or_cancel(aws: list) -> list:
    """Await all; on the first failure cancel the rest (their workers stop) and raise it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _unavailable(family: str, e: Exception) -> Failure:
    """Map a failure to reach a worker to 503 (retryable) and anything else to 500, logging the latter."""
    if isinstance(e, BackPressureError):
        return Failure(503, f"the {family} queue is full; retry later")
    if isinstance(e, (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)):
        return Failure(503, f"a {family} replica was lost ({type(e).__name__}); retry")
    log.exception("request to %s failed", family, exc_info=e)
    return Failure(500, f"internal error in {family} ({type(e).__name__}); see the server logs")


@serve.deployment(name="Router", max_ongoing_requests=256)
@serve.ingress(api)
class Router:
    async def __init__(
        self,
        workers: dict[str, DeploymentHandle],
        limits: dict[str, dict[str, Any]],  # family -> FamilyLimits fields
        redis_url: str | None = None,  # None: no rank cache
        rank_cache: dict[str, Any] | None = None,  # RankCache options: threshold, max_entries, thresholds
        api_key_env: str | None = None,  # name of the environment variable holding comma-separated API keys
        embed_device: str = "cpu",
        embed_threads: int = 1,
        ready_timeout_s: float = 5.0,  # /readyz: how long each family's worker has to answer
    ):
        import torch

        torch.set_num_threads(embed_threads)
        self.workers = workers
        self.limits = {f: FamilyLimits(**v) for f, v in limits.items()}
        self.keys = ApiKeys.from_env(api_key_env)
        self.ready_timeout_s = ready_timeout_s
        self.embedder = Embedder(device=embed_device)
        self.cache = RankCache(redis_url, **(rank_cache or {})) if redis_url else None
        if self.cache is not None:
            self.cache.start([])
        self.versions: dict[str, str] = {}
        self.created: dict[str, int] = {}  # family -> unix time its checkpoint was written (/v1/models)
        self.templates: dict[str, ChatTemplate] = {}  # family -> its chat template (from its worker)
        self.started = int(time.time())  # /v1/models' `created` until a family's worker has answered
        self._versions_locks = {f: asyncio.Lock() for f in self.limits}  # one family's slow start blocks only it
        self._background: set[asyncio.Task] = set()

        fam, proto = ("family",), ("family", "protocol")
        self.m_requests = Counter("rankserve_requests", "requests answered by the router, by status",
                                  tag_keys=("family", "protocol", "status"))
        self.m_latency = Histogram("rankserve_request_latency_seconds", "request in to last byte out",
                                   LATENCY_BUCKETS, proto)
        self.m_ttft = Histogram("rankserve_time_to_first_token_seconds", "request in to first token out (streams)",
                                LATENCY_BUCKETS, proto)
        self.m_overhead = Histogram("rankserve_router_overhead_seconds", "embed + rank-cache lookup",
                                    OVERHEAD_BUCKETS, fam)
        self.m_embed = Histogram("rankserve_embed_seconds", "MiniLM embedding of the prompt", OVERHEAD_BUCKETS, fam)
        self.m_lookup = Histogram("rankserve_rank_cache_lookup_seconds", "local FAISS lookup", OVERHEAD_BUCKETS, fam)
        self.m_hits = Counter("rankserve_rank_cache_hits", "rank-cache hits", tag_keys=fam)
        self.m_misses = Counter("rankserve_rank_cache_misses", "rank-cache misses", tag_keys=fam)
        self.m_size = Gauge("rankserve_rank_cache_size", "entries in this replica's index", tag_keys=fam)
        self.m_redis_up = Gauge("rankserve_rank_cache_redis_up", "1 if Redis answers, 0 if serving without it")
        self._report_redis()
        self._housekeeping = asyncio.create_task(self._keep_house())

    # ---- HTTP ------------------------------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    async def _http(self, request: Request, chat: bool):
        t0 = time.perf_counter()
        family = "-"
        try:
            self._authorize(request.headers.items())
            routed = await self._route(await request.body(), chat)
            family = routed[0].req.model
            if routed[0].req.stream:
                streams = [self._events(r) for r in routed]
                try:  # errors before the first choice starts still get a proper status; later ones go in-band
                    first = await anext(streams[0])
                except BaseException:
                    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                    raise
                # the headers go now: a later prompt's cached subset its worker refuses still shows as a hit here
                return StreamingResponse(self._sse(routed, first, streams, t0), media_type="text/event-stream",
                                         headers=_cache_headers(routed))
            outs = await _gather_or_cancel([self._generate(r) for r in routed])
        except Failure as f:
            self._count(family, "http", f.status, t0)
            return JSONResponse(error_body(f.message, ERROR_TYPE[f.status], f.param), status_code=f.status,
                                headers={"www-authenticate": "Bearer"} if f.status == 401 else None)
        self._count(family, "http", 200, t0)
        choices = []
        for r, out in zip(routed, outs):
            if r.req.echo:  # completions only: the prompt first, in the text and the logprobs
                lp = None if r.req.logprobs is None else completion_logprobs(out["logprobs"], out["prompt_logprobs"],
                                                                             len(r.text))
                choices.append(Choice(r.text + out["text"], out["finish_reason"], lp))
            else:
                choices.append(Choice(out["text"], out["finish_reason"], _logprobs(r, out["logprobs"])))
        build, prefix = (chat_completion_body, "chatcmpl") if chat else (completion_body, "cmpl")
        n_prompt = sum(out["prompt_tokens"] for r, out in zip(routed, outs) if r.write_back)  # once per prompt
        body = build(new_id(prefix), family, choices, n_prompt, sum(out["completion_tokens"] for out in outs))
        return JSONResponse(body, headers=_cache_headers(routed))

    async def _sse(self, routed: list[Routed], first: dict, streams: list[AsyncIterator[dict]], t0: float):
        """Server-sent events: one chunk per released piece of text (chat: after a chunk naming the role), then
        each choice's finish chunk, the usage (on the last finish chunk, or as OpenAI's extra chunk when
        stream_options asks for it), and [DONE]. Several choices (n, a list of prompts) interleave, each chunk
        naming its choice's `index`. With logprobs, each chunk carries the entries of its tokens since the
        previous one (a token held back for a possible stop string goes out with the text that releases it)."""
        req, chat, family = routed[0].req, routed[0].chat, routed[0].req.model
        id = new_id("chatcmpl" if chat else "cmpl")
        tags = {"family": family, "protocol": "http"}
        status, total = 200, None

        def chunk(i: int, text: str, entries: list[dict], finish_reason: str | None = None,
                  usage_: dict | None = None, prompt: bool = False) -> str:
            lp = _logprobs(routed[i], entries, prompt)
            if not chat:
                return _sse_line(chunk_body(id, family, text, finish_reason, usage_, lp, i))
            return _sse_line(chat_chunk_body(id, family, {"content": text} if text else {}, finish_reason, usage_,
                                             lp, i))

        merged = _merge(streams)
        try:
            if chat:
                for i in range(len(routed)):
                    yield _sse_line(chat_chunk_body(id, family, {"role": "assistant", "content": ""}, index=i))
            if req.echo:  # choice 0's start event was read already: its echoed prompt goes first
                yield chunk(0, routed[0].text, first.get("prompt_logprobs") or [], prompt=True)
            # and its prompt tokens start the count
            async for i, ev, entries, total in self._pieces(merged, routed, t0, tags, first["prompt_tokens"]):
                if ev["event"] == "start":  # echo: a choice's prompt, before its tokens
                    yield chunk(i, routed[i].text, entries, prompt=True)
                elif ev["event"] == "token":
                    yield chunk(i, ev["text"], entries)
                else:  # the last finish chunk carries the usage, unless OpenAI's extra chunk does
                    yield chunk(i, "", entries, ev["finish_reason"], None if req.include_usage else total)
            if req.include_usage:  # as OpenAI: one more chunk, no choices, the request's usage
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse_line(usage_chunk_body(id, family, obj, total))
            yield "data: [DONE]\n\n"
        except Failure as f:  # mid-stream: the status line is sent, so report in-band
            status = f.status
            yield _sse_line(error_body(f.message, ERROR_TYPE[f.status]))
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # client closed the connection; the workers stop at their next token
            raise
        finally:
            await merged.aclose()  # a stream still running (client gone, or another choice failed): stop it
            # and those the merge never started (the client left during the role chunks): choice 0's runs already
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            self._count(family, "http", status, t0)

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request.headers.items())
        except Failure as f:
            return JSONResponse(error_body(f.message, ERROR_TYPE[401]), status_code=401,
                                headers={"www-authenticate": "Bearer"})
        return {"object": "list", "data": [
            {"id": f, "object": "model", "created": self.created.get(f, self.started), "owned_by": "rankserve",
             "max_tokens": lim.max_tokens, "model_version": self.versions.get(f)}
            for f, lim in sorted(self.limits.items())]}

    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz(self, request: Request):
        """Ready when every family's worker answers now (all asked at once, each within ready_timeout_s); the rank
        cache is reported, not required. Without a valid API key (when keys are set) only {"status"}: probes need
        no key, and which families and model versions are served is for key holders."""
        fams = list(self.limits)
        answers = await asyncio.gather(*(self._ready(f) for f in fams), return_exceptions=True)
        # readiness reports any failure to reach a worker as "not ready"
        missing = [f"{f}: {type(a).__name__}" for f, a in zip(fams, answers) if isinstance(a, Exception)]
        body = {"status": "ok" if not missing else "unavailable"}
        if self.keys.allows(list(request.headers.items())):
            body.update(families=self.versions, unavailable=missing,
                        rank_cache_redis_up=bool(self.cache and self.cache.redis_up))
        return JSONResponse(body, status_code=200 if not missing else 503)

    # ---- gRPC ------------------------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateReply:
        return await self._grpc(request, grpc_context, chat=False)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateChunk]:
        async for chunk in self._grpc_stream(request, grpc_context, chat=False):
            yield chunk

    async def Chat(self, request: pb.ChatRequest, grpc_context) -> pb.GenerateReply:
        return await self._grpc(request, grpc_context, chat=True)

    async def ChatStream(self, request: pb.ChatRequest, grpc_context) -> AsyncIterator[pb.GenerateChunk]:
        async for chunk in self._grpc_stream(request, grpc_context, chat=True):
            yield chunk

    async def _grpc(self, request, grpc_context, chat: bool) -> pb.GenerateReply:
        t0 = time.perf_counter()
        family = "-"
        try:
            self._authorize(grpc_context.invocation_metadata())
            routed = await self._route(_from_proto(request), chat)  # one Routed per choice
            family = routed[0].req.model
            outs = await _gather_or_cancel([self._generate(r) for r in routed])
        except Failure as f:
            self._count(family, "grpc", f.status, t0)
            grpc_context.set_code(GRPC_CODE[f.status])
            grpc_context.set_details(f.message)
            return pb.GenerateReply()
        self._count(family, "grpc", 200, t0)
        choices = []
        for i, (r, out) in enumerate(zip(routed, outs)):
            echo = r.req.echo  # completions only: the prompt first, in the text and the logprobs
            choices.append(pb.Choice(
                index=i, text=r.text + out["text"] if echo else out["text"], token_ids=out["token_ids"],
                finish_reason=out["finish_reason"],
                logprobs=_proto_logprobs(out["logprobs"], out["prompt_logprobs"], len(r.text)) if echo else
                _proto_logprobs(out["logprobs"])))
        n_prompt = sum(out["prompt_tokens"] for r, out in zip(routed, outs) if r.write_back)  # once per prompt
        first = choices[0]
        return pb.GenerateReply(
            id=new_id("chatcmpl" if chat else "cmpl"), model=family, text=first.text, token_ids=first.token_ids,
            finish_reason=first.finish_reason, logprobs=first.logprobs, choices=choices,
            usage=pb.Usage(**usage(n_prompt, sum(out["completion_tokens"] for out in outs))),
            rank_cache_hit=routed[0].hit is not None)

    async def _grpc_stream(self, request, grpc_context, chat: bool) -> AsyncIterator[pb.GenerateChunk]:
        """One chunk per released piece of text, with the logprob entries of the tokens it releases, then each
        choice's finish chunk; several choices (n) interleave, each chunk naming its `index`, and the usage rides
        on the last finish chunk."""
        t0 = time.perf_counter()
        family, status, id, merged, streams = "-", 200, new_id("chatcmpl" if chat else "cmpl"), None, []
        try:
            self._authorize(grpc_context.invocation_metadata())
            routed = await self._route(_from_proto(request, stream=True), chat)
            family = routed[0].req.model
            tags = {"family": family, "protocol": "grpc"}
            streams = [self._events(r) for r in routed]
            merged = _merge(streams)
            async for i, ev, entries, total in self._pieces(merged, routed, t0, tags):
                moved = len(routed[i].text) if routed[i].req.echo else 0  # echo: offsets past the prompt
                if ev["event"] == "start":  # echo: a choice's prompt first, in a chunk of no token (token_id 0)
                    yield pb.GenerateChunk(id=id, index=i, text=routed[i].text, logprobs=_proto_logprobs(entries))
                elif ev["event"] == "token":
                    yield pb.GenerateChunk(id=id, index=i, text=ev["text"], token_id=ev["token_id"],
                                           logprobs=_proto_logprobs(entries, None, moved))
                else:
                    yield pb.GenerateChunk(id=id, index=i, finish_reason=ev["finish_reason"],
                                           usage=None if total is None else pb.Usage(**total),
                                           logprobs=_proto_logprobs(entries, None, moved))
        except Failure as f:
            status = f.status
            grpc_context.set_code(GRPC_CODE[f.status])
            grpc_context.set_details(f.message)
            raise  # a stream's status only reaches the client through an exception (Serve keeps the code set here)
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        finally:
            if merged is not None:
                await merged.aclose()
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            self._count(family, "grpc", status, t0)

    async def _pieces(self, merged: AsyncIterator[tuple[int, dict]], routed: list[Routed], t0: float,
                      tags: dict[str, str], n_prompt: int = 0
                      ) -> AsyncIterator[tuple[int, dict, list[dict], dict | None]]:
        """What a stream sends, from its choices' merged worker events: (choice, a token event that releases text,
        an end event, or with echo a start event, the logprob entries of the tokens it releases (a start event:
        the prompt's), the request's usage on the last end event else None). A token whose text is held back (a
        possible stop string) sends its entries with the next one. Each prompt's tokens count once (`n_prompt`:
        those of start events read already); observes the time to the first token."""
        pending: list[list[dict]] = [[] for _ in routed]  # per choice: entries of tokens held back
        completion, left, first_token = 0, len(routed), True
        async for i, ev in merged:
            if ev["event"] == "start":
                if routed[i].write_back:
                    n_prompt += ev["prompt_tokens"]
                if routed[i].req.echo:  # the caller sends the prompt, with its own entries (echo + logprobs)
                    yield i, ev, ev.get("prompt_logprobs") or [], None
            elif ev["event"] == "token":
                pending[i].extend(ev.get("logprobs", ()))
                if not ev["text"]:
                    continue
                if first_token:
                    self.m_ttft.observe(time.perf_counter() - t0, tags=tags)
                    first_token = False
                yield i, ev, pending[i], None
                pending[i] = []
            elif ev["event"] == "end":
                completion, left = completion + ev["completion_tokens"], left - 1
                yield i, ev, pending[i], usage(n_prompt, completion) if left == 0 else None
                pending[i] = []

    # ---- shared path -----------------------------------------------------------------------------------------

    def _authorize(self, headers) -> None:
        if not self.keys.allows(list(headers)):
            raise Failure(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                               "(gRPC: metadata 'authorization')")

    async def _route(self, body: bytes | dict[str, Any], chat: bool = False) -> list[Routed]:
        """Validate (the one validation of both protocols), render a chat, then one Routed per choice (prompt-major,
        then n): each prompt embedded and looked up in the rank cache once, its n choices sharing the outcome."""
        try:
            req = parse_request(body, ChatRequest if chat else CompletionRequest)
            limits = check_request(req, self.limits)
        except RequestError as e:
            raise Failure(400, e.message, e.param) from None
        version = await self._version(req.model)
        if chat:
            try:
                if sum(len(m.text) for m in req.messages) < RENDER_INLINE_CHARS:
                    req = req.to_completion(self.templates[req.model], limits)
                else:  # a long conversation renders on a thread: the event loop serves other requests meanwhile
                    req = await asyncio.to_thread(req.to_completion, self.templates[req.model], limits)
            except RequestError as e:
                raise Failure(400, e.message, e.param) from None
        choices = req.choices()
        looked = await asyncio.gather(*(self._lookup(c, version, chat) for c in choices[::req.n]))
        return [dataclasses.replace(looked[i // req.n], req=c, write_back=i % req.n == 0)
                for i, c in enumerate(choices)]

    async def _lookup(self, req: CompletionRequest, version: str, chat: bool) -> Routed:
        """Embed one prompt (token ids: their text, decoded by the family's worker) and look it up in the rank
        cache."""
        text = req.prompt if isinstance(req.prompt, str) else await self._detokenize(req.model, req.prompt)
        t0 = time.perf_counter()
        # the embedder reads a prompt's start; a chat's start is often the same system prompt and history, and
        # what sets this request apart is its last turn: the rendered conversation's tail is its key
        vec = await self._embed(text[-self.embedder.max_chars:] if chat else text)
        if isinstance(vec, Exception):  # this prompt alone failed its embedding (see _embed): our bug, not the input's
            log.error("embedding a %s prompt failed", req.model, exc_info=vec)
            raise Failure(500, f"internal error embedding the prompt ({type(vec).__name__}); see the server logs")
        t1 = time.perf_counter()
        hit = self.cache.lookup(req.model, version, vec) if self.cache else None
        t2 = time.perf_counter()
        tags = {"family": req.model}
        self.m_embed.observe(t1 - t0, tags=tags)
        self.m_lookup.observe(t2 - t1, tags=tags)
        self.m_overhead.observe(t2 - t0, tags=tags)
        if hit is None:  # a hit counts once its worker takes the cached subset (_settle)
            self.m_misses.inc(tags=tags)
        if self.cache is not None:
            self.m_size.set(self.cache.size(req.model, version), tags=tags)
        self._report_redis()
        return Routed(req, version, vec, hit, t2 - t0, t2 - t1, chat, text=text)

    async def _detokenize(self, family: str, ids: list[int]) -> str:
        """The text of a token-id prompt, from the family's tokenizer (a worker's); 400 for an id it has no
        token for."""
        try:
            out = await self.workers[family].detokenize.remote(ids)
        except Exception as e:
            raise _unavailable(family, e)
        if out.get("event") == "error":
            raise Failure(out["status"], out["message"], out["param"])
        return out["text"]

    async def _generate(self, routed: Routed) -> dict[str, Any]:
        """One whole generation. Cancelling this (a sibling choice failed, the client left) cancels the worker's."""
        req = routed.req
        resp = self.workers[req.model].generate.remote(req.prompt, req.sampling(), routed.hit is not None,
                                                       routed.hit.subset if routed.hit else None, req.echo)
        try:
            out = await resp
        except asyncio.CancelledError:
            resp.cancel()  # awaiting no more doesn't stop the worker: the request would hold a batch row
            raise
        except Exception as e:
            raise _unavailable(req.model, e)
        if out["event"] == "error":
            raise Failure(out["status"], out["message"], out["param"])
        self._settle(routed, out)
        if out["finish_reason"] == "timeout":
            raise Failure(408, f"the request passed the {req.model} request timeout after "
                               f"{out['completion_tokens']} tokens; ask for fewer tokens or stream")
        return out

    async def _events(self, routed: Routed) -> AsyncIterator[dict]:
        """The worker's event stream; raises Failure for an error event. Cancelling this cancels the worker."""
        req = routed.req
        gen = self.workers[req.model].options(stream=True).stream.remote(
            req.prompt, req.sampling(), routed.hit is not None, routed.hit.subset if routed.hit else None, req.echo)
        done = False
        try:
            async for ev in gen:
                if ev["event"] == "error":
                    raise Failure(ev["status"], ev["message"], ev["param"])
                if ev["event"] == "start":
                    self._settle(routed, ev)
                yield ev
            done = True
        except Failure:
            raise
        except Exception as e:  # CancelledError / GeneratorExit (client gone) are BaseExceptions: they pass
            raise _unavailable(req.model, e)
        finally:
            if not done:
                gen.cancel()  # the client went away (or we failed): stop the worker at its next token

    async def _version(self, family: str) -> str:
        """The family's model version, asked of its worker once; starts tracking that rank-cache space."""
        if family not in self.versions:
            async with self._versions_locks[family]:
                if family not in self.versions:
                    try:
                        info = await self.workers[family].info.remote()
                    except Exception as e:
                        raise _unavailable(family, e)
                    if self.cache is not None:
                        await asyncio.to_thread(self.cache.track, family, info["model_version"])
                    self.created[family] = info["created"]
                    self.templates[family] = ChatTemplate(**info.get("chat_template", {}))  # {}: an older worker
                    self.versions[family] = info["model_version"]
        return self.versions[family]

    async def _ready(self, family: str) -> None:
        """Raise unless the family's worker answers within ready_timeout_s. Asked every time, never cached: a worker
        that died must show as not ready."""
        resp = self.workers[family].info.remote()
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                await resp
        except TimeoutError:
            resp.cancel()  # awaiting no more doesn't cancel the call: don't leave it queued behind a stuck replica
            raise
        await asyncio.wait_for(self._version(family), self.ready_timeout_s)  # at once after the first time

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def _embed(self, prompts: list[str]) -> list[np.ndarray | Exception]:
        """Concurrent requests' prompts embedded together, off the event loop: each one's (384,) vector, or the
        exception that embedding it alone raised (the caller fails that request only)."""
        try:
            x = await asyncio.to_thread(self.embedder.embed, prompts)  # (N, 384)
        except Exception:  # one prompt can break the whole batch: embed each alone so only its own request fails
            return await asyncio.to_thread(_embed_each, self.embedder, prompts)
        return list(x)

    def _settle(self, routed: Routed, start: dict[str, Any]) -> None:
        """The rank-cache outcome of one prompt (its first choice), from its worker's start event or result: a hit
        counts once the worker takes the cached subset; one it refuses (fails this model's routers' checks) is a
        miss, and leaves the cache; a miss's fresh choice is written back."""
        if not routed.write_back:
            return
        tags = {"family": routed.req.model}
        if routed.hit is not None and start.get("cache_rejected", False):  # .get: a worker from before the field
            self._in_background(self.cache.discard, routed.req.model, routed.version, routed.hit.id)
            routed.hit = None  # the header and gRPC's rank_cache_hit say miss
            self.m_misses.inc(tags=tags)
        elif routed.hit is not None:
            self.m_hits.inc(tags=tags)
        if not start["cached"]:  # a miss, or a cached subset the worker could not use
            self._write_back(routed, start["subset"])

    def _write_back(self, routed: Routed, subset: dict | None) -> None:
        """Store the worker's choice for this prompt, in the background (Redis being slow never delays a token)."""
        if self.cache is not None:
            self._in_background(self.cache.insert, routed.req.model, routed.version, routed.vec, subset)

    def _in_background(self, fn, *args) -> None:
        """Run a rank-cache call on a thread without awaiting it; the task is kept until it ends."""
        task = asyncio.create_task(asyncio.to_thread(fn, *args))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _keep_house(self, period_s: float = 5.0) -> None:
        """At start, learn every family's model version, which loads its rank-cache space from Redis (requests
        would do it lazily otherwise); then keep the cache gauges current even without traffic."""
        pending = set(self.limits)
        while True:
            for f in list(pending):
                try:
                    await asyncio.wait_for(self._version(f), timeout=period_s)
                    pending.discard(f)
                except Exception as e:  # the worker isn't up yet: try again next round (requests retry on their own)
                    log.debug("rank cache for %s not loaded yet: %s", f, e)
            self._report_redis()
            if self.cache is not None:
                for f, v in self.versions.items():
                    self.m_size.set(self.cache.size(f, v), tags={"family": f})
            await asyncio.sleep(period_s)

    def _report_redis(self) -> None:
        self.m_redis_up.set(1 if self.cache is not None and self.cache.redis_up else 0)

    def _count(self, family: str, protocol: str, status: int, t0: float) -> None:
        self.m_requests.inc(tags={"family": family, "protocol": protocol, "status": str(status)})
        self.m_latency.observe(time.perf_counter() - t0, tags={"family": family, "protocol": protocol})

    def __del__(self):  # Serve calls this when it stops the replica
        if getattr(self, "_housekeeping", None) is not None:
            self._housekeeping.cancel()
        if getattr(self, "cache", None) is not None:
            self.cache.close()
