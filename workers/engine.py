"""Engine: prompts in, tokens out. Holds one model, its tokenizer and the generation loop.

generate → prefill (the whole batch, right-padded, into a fresh dense KV cache) → decode steps (one token
per row per step) until every row hits EOS, a stop token or string, or its token budget.
A PARSE checkpoint masks each row's rank components once at prefill and keeps them for every decode step of the
request (rank reuse; `workers/parse.py`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from rankserve.workers.align import GPU_ALIGN, pad_ranks
from rankserve.workers.checkpoint import Manifest, load_checkpoint
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import Transformer
from rankserve.workers.parse import Routers, apply, clear, load_parse, route_scores, select, validate
from rankserve.workers.parse_batching import component_cost, group_by_overlap, membership, select_together
from rankserve.workers.parse_decode import ParseSlots
from rankserve.workers.sampler import SamplingParams, sample
from rankserve.workers.tokenizer import Tokenizer


BATCH_BUCKETS = (1, 2, 4, 8)  # the fast path's batch sizes: a batch runs in the next one up, padded with idle rows
PROMPT_CHUNK = 256  # prompt positions per piece of the head when scoring a prompt (prompt_logprobs)
LOGPROB_FLOOR = -9999.0  # what a -inf (or NaN) log-probability is reported as: JSON has no infinities


@dataclass
class TokenLogprob:
    """What `SamplingParams.logprobs` asks for, per generated token. Log-probabilities are the model's own (its
    logits before temperature, top-k or top-p), so they don't depend on how the token was drawn."""

    token: str  # the token's text after the tokens before it (a SentencePiece leading space survives)
    logprob: float | None  # None only for a prompt's first token without a BOS before it (nothing predicts it)
    bytes: list[int]  # the token's own bytes (exact where its text is part of a UTF-8 character)
    offset: int  # where its text starts in the generated text
    top: list[tuple[str, float, list[int]]]  # the `logprobs` most likely tokens: (text, logprob, bytes), best first


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprob] | None = None  # when asked for: the tokens that wrote `text` (not a stop token,
                                                # nor those of a stop string past the cut)


@dataclass
class StreamEvent:
    token_id: int
    text: str  # new text since the previous event (may be empty while a stop string is undecided)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # when asked for: the entries of the tokens whose text this event
                                                # releases (a token held back for a stop string comes later)


class _Row:
    """Decoding state of one request: its tokens, the text already released, and why it stopped."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos: tuple[int, ...]) -> None:
        self.prompt_ids, self.params = prompt_ids, params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        self.gen = params.generator() if params.temperature > 0 else None
        self.ids: list[int] = []
        self.released = ""
        self.finish: str | None = None
        self.context = prompt_ids[-4:]  # decoded with the new tokens so a leading space survives (SentencePiece)
        self.context_text: str | None = None
        self.logprobs: list[TokenLogprob] = []  # one per token pushed (stop tokens included), when asked for
        self.logprobs_sent = 0  # entries handed out by `new_logprobs`
        self.cut = False  # ended on a stop string (the text was cut)
        self.text_len = 0  # characters of the generated tokens' text (before any cut): the next token's offset

    def push(self, token: int, tok: Tokenizer, last: bool = False) -> str:
        """Append a token; return the newly releasable text and set `finish` when the row is done (`last`: the
        context is full after this token). A row that ends other than on a stop string releases the tail it held
        back for one."""
        if token in self.stop_ids:
            self.finish = "stop"
            return self._release(self._text(tok))
        self.ids.append(token)
        text = self._text(tok)
        self.text_len = len(text)
        for s in self.params.stop:
            at = text.find(s)
            if at >= 0:
                self.finish, text, self.cut = "stop", text[:at], True
        if self.finish is None and (last or len(self.ids) >= self.params.max_new_tokens):
            self.finish = "length"
        if self.finish is None:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next byte
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            for n in range(min(hold, len(text)), 0, -1):  # hold back a tail that may start a stop string
                if any(s.startswith(text[-n:]) for s in self.params.stop):
                    text = text[:-n]
                    break
        return self._release(text)

    def _text(self, tok: Tokenizer) -> str:
        """The generated tokens' text, decoded after the prompt's last tokens (a leading space survives)."""
        if self.context_text is None:
            self.context_text = tok.decode(self.context)
        full = tok.decode(self.context + self.ids)
        return full[len(self.context_text):] if full.startswith(self.context_text) else tok.decode(self.ids)

    def logprob(self, logits: torch.Tensor, token: int, tok: Tokenizer) -> None:
        """Record `token`'s log-probability and the step's most likely tokens (before `push(token)`)."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        top = torch.topk(lp, self.params.logprobs) if self.params.logprobs else None
        ids = top.indices.tolist() if top is not None else []
        vals = top.values.tolist() if top is not None else []
        ctx = (self.context + self.ids)[-4:]  # each token's text is read after the tokens before it
        (t_text, v, b), *alts = _entries(tok, ctx, [(token, float(lp[token])), *zip(ids, vals)])
        self.logprobs.append(TokenLogprob(t_text, v, b, self.text_len, alts))

    def released_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens whose text is out: while running, those starting before the released text's
        end; once done, every token's but a stop token's, or up to a stop string's cut."""
        n = len(self.ids)  # a stop token's entry (the last one) is never counted: it writes no text
        if self.finish is None or self.cut:
            end = len(self.released)
            n = sum(1 for l in self.logprobs[:n] if l.offset < end)
        return self.logprobs[:n]

    def new_logprobs(self) -> list[TokenLogprob]:
        """Entries released since the previous call."""
        out = self.released_logprobs()[self.logprobs_sent:]
        self.logprobs_sent += len(out)
        return out

    def _release(self, text: str) -> str:
        delta = text[len(self.released):] if text.startswith(self.released) else ""
        self.released = text if text.startswith(self.released) else self.released
        return delta


def _entries(tok: Tokenizer, ctx: list[int], picks: list[tuple[int, float]]) -> list[tuple[str, float, list[int]]]:
    """(token, logprob) pairs -> (the token's text read after the ids `ctx`, so a leading space survives; the
    logprob, -inf and NaN floored: JSON has no infinities; the token's bytes)."""
    before = tok.decode(ctx)

    def text(t: int) -> str:
        full = tok.decode(ctx + [t])
        return full[len(before):] if full.startswith(before) else tok.decode([t])

    return [(text(t), v if v > LOGPROB_FLOOR else LOGPROB_FLOOR, list(tok.token_bytes(t))) for t, v in picks]


def generation_eos(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of the checkpoint's generation_config.json: chat models list their end-of-turn token there (Llama 3's
    <|eot_id|>, Qwen's <|im_end|>) while config.json names only the end of text."""
    path = Path(model_dir) / "generation_config.json"
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):  # not a JSON object: ignored, as HF would fail
        return ()
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return tuple(int(i) for i in eos if isinstance(i, int) and not isinstance(i, bool))


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, manifest: Manifest | None = None,
                 max_batch_size: int = 8, max_seq_len: int | None = None,
                 fast_path: str = "auto",  # "auto": Triton + CUDA graphs on CUDA, eager on CPU; "off"; "torch"|"triton"
                 routers: Routers | None = None,  # PARSE routers (`workers.parse.load_parse`); None = static ranks
                 reroute_every: int = 0,  # PARSE: re-run the routers every N generated tokens; 0 = never
                 # PARSE, generate_batch: route each batch together (workers/parse_batching.select_together): on the
                 # reference model 0.2 cut a batch of 8's union from 1.18 K to 1.02 K and lowered perplexity
                 # (477 -> 472; parse-log.md); 0 = every request its own routers' top-K
                 parse_pull: float = 0.2,
                 extra_eos: tuple[int, ...] = (),  # more ids that end a reply (generation_config.json's)
                 # bytes the fast path's decoders (KV caches, PARSE slot weights) may hold together; the least
                 # recently used go first. None: 40 % of the GPU's memory (unbounded on the CPU)
                 decoder_memory_bytes: int | None = None) -> None:
        if parse_pull < 0:
            raise ValueError(f"parse_pull must be >= 0, got {parse_pull}")
        self.model, self.tokenizer, self.manifest = model, tokenizer, manifest
        self.routers, self.reroute_every, self.parse_pull = routers, reroute_every, parse_pull
        self.cfg = model.cfg
        self.max_batch_size = max_batch_size
        self.max_seq_len = min(max_seq_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        self.device = model.embed.weight.device
        self.eos = self.cfg.eos_ids or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
        self.eos = tuple(dict.fromkeys(self.eos + tuple(extra_eos)))
        if fast_path not in ("auto", "off", "torch", "triton"):
            raise ValueError(f"fast_path must be 'auto', 'off', 'torch' or 'triton', got {fast_path!r}")
        self.fast_path = fast_path
        self._decoders: dict[tuple[int, int], FastDecoder] = {}
        self._slots: dict[tuple[int, int], ParseSlots] = {}  # PARSE rank slots per (B, S) bucket
        if decoder_memory_bytes is None and self.device.type == "cuda":
            decoder_memory_bytes = int(0.4 * torch.cuda.get_device_properties(self.device).total_memory)
        self.decoder_memory_bytes = decoder_memory_bytes
        self._held: OrderedDict[tuple[str, int, int], int] = OrderedDict()  # built decoders' bytes, LRU first
        self._packed: dict[bool, list] = {}  # packed decode weights per fused-norm layout, shared by decoders

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
             max_batch_size: int = 8, max_seq_len: int | None = None, fast_path: str = "auto",
             reroute_every: int = 0, parse_pull: float = 0.2, decoder_memory_bytes: int | None = None) -> "Engine":
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        model, manifest = load_checkpoint(model_dir, device=device, dtype=dtype)
        routers = load_parse(model_dir, model)  # checks the stored ranks: before padding
        if model.embed.weight.device.type == "cuda":
            pad_ranks(model, GPU_ALIGN)  # exact; aligned rows for cuBLAS and Triton (workers/align.py)
        return cls(model, Tokenizer.load(model_dir), manifest, max_batch_size, max_seq_len, fast_path,
                   routers=routers, reroute_every=reroute_every, parse_pull=parse_pull,
                   extra_eos=generation_eos(model_dir), decoder_memory_bytes=decoder_memory_bytes)

    # --- public API ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, params: SamplingParams | None = None, room: int = 1) -> list[int]:
        """The prompt's ids (BOS first); refused when empty or when it leaves fewer than `room` positions of the
        context (1: the first generated token; 0: scoring the prompt alone)."""
        ids = self.tokenizer.encode(prompt, bos=True)
        if not ids:
            raise ValueError("the prompt is empty and this tokenizer adds no BOS token: give at least one token")
        if len(ids) + room > self.max_seq_len:
            raise ValueError(f"prompt is {len(ids)} tokens; the context limit is {self.max_seq_len} tokens")
        return ids

    def generate(self, prompt: str, params: SamplingParams | None = None, subset: dict | None = None) -> GenerationResult:
        return self.generate_batch([prompt], [params or SamplingParams()], subset)[0]

    def generate_batch(self, prompts: list[str], params: list[SamplingParams],
                       subset: dict | None = None) -> list[GenerationResult]:
        """Results in the prompts' order. More prompts than max_batch_size run as several batches; with PARSE
        routers (and no common `subset`) the batches are formed by subset overlap (workers/parse_batching.py),
        otherwise in order."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        rows = [_Row(self.encode_prompt(p, sp), sp, self.eos) for p, sp in zip(prompts, params)]
        B = self.max_batch_size
        routed, scores = None, None
        if self.routers is not None and subset is None:
            scores = [route_scores(self.model, self.routers, torch.tensor([r.prompt_ids])) for r in rows]
            routed = [select_together(s, self.routers, 0.0)[0] for s in scores]  # own top-K: what grouping compares
        if routed is not None and len(rows) > B:
            shapes = {n: (l.out_features, l.in_features) for n, l in self.model.projections().items()}
            groups = group_by_overlap(membership(routed, self.routers), component_cost(self.routers, shapes), B)
        else:
            groups = [list(range(i, min(i + B, len(rows)))) for i in range(0, len(rows), B)]
        if scores is not None and self.parse_pull > 0:  # then each batch routed together: a smaller union
            for g in groups:
                together = select_together({n: torch.cat([scores[i][n] for i in g]) for n in self.routers.k},
                                           self.routers, self.parse_pull)
                for i, sub in zip(g, together):
                    routed[i] = sub
        for g in groups:
            for _ in self._decode([rows[i] for i in g], subset, None if routed is None else [routed[i] for i in g]):
                pass
        return [GenerationResult(r.released, r.ids, len(r.prompt_ids), r.finish or "length",
                                 r.released_logprobs() if r.params.logprobs is not None else None) for r in rows]

    def stream(self, prompt: str, params: SamplingParams | None = None, subset: dict | None = None) -> Iterator[StreamEvent]:
        """Yield one event per generated token; closing the generator cancels the request."""
        row = _Row(self.encode_prompt(prompt, params or SamplingParams()), params or SamplingParams(), self.eos)
        for step in self._decode([row], subset):
            token, delta = step[0]
            yield StreamEvent(token, delta, row.finish, row.new_logprobs() if row.params.logprobs is not None else None)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: str, top: int = 0, subset: dict | None = None) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the tokens before it, and the `top` most likely tokens at its
        position (one teacher-forced forward; OpenAI's `echo` with `logprobs`). The BOS the engine prepends has no
        entry; without a BOS the first token has no context and its logprob is None. `offset` counts characters
        of the tokens' own text from the prompt's start. PARSE: scored with `subset` (None: the routers' choice)."""
        ids = self.encode_prompt(prompt, room=0)
        if self.routers is not None:
            apply(self.model, [validate(subset, self.routers) if subset is not None else
                               select(self.model, self.routers, ids)])
        try:
            h = self.model(torch.tensor([ids], device=self.device), head=False)[0]  # (S, hidden)
        finally:
            if self.routers is not None:
                clear(self.model)
        # the head in pieces: S x V fp32 logits at once would be GBs for a long prompt and a large vocabulary
        k = min(top, self.cfg.vocab_size)
        target = torch.tensor(ids[1:], device=self.device)
        picked, top_v, top_i = [], [], []
        for c in range(0, len(ids) - 1, PROMPT_CHUNK):  # position i predicts token i + 1
            lp = torch.log_softmax(F.linear(h[c:c + PROMPT_CHUNK], self.model.head_weight()).float(), -1)
            lp = lp[:len(ids) - 1 - c]
            picked.append(lp.gather(1, target[c:c + len(lp), None])[:, 0])
            if k:
                t = torch.topk(lp, k)
                top_v.append(t.values)
                top_i.append(t.indices)
        picked_l = torch.cat(picked).tolist() if picked else []
        top_v_l = torch.cat(top_v).tolist() if top_v else []
        top_i_l = torch.cat(top_i).tolist() if top_i else []
        skip = 1 if ids[0] == self.tokenizer.bos_id else 0
        out, offset = [], 0
        for i in range(skip, len(ids)):
            ctx = ids[max(skip, i - 4):i]
            if i == 0:  # no context: nothing predicts it
                (t_text, _, b), = _entries(self.tokenizer, ctx, [(ids[0], 0.0)])
                out.append(TokenLogprob(t_text, None, b, offset, []))
            else:
                alts = zip(top_i_l[i - 1], top_v_l[i - 1]) if k else ()
                (t_text, v, b), *top_e = _entries(self.tokenizer, ctx, [(ids[i], picked_l[i - 1]), *alts])
                out.append(TokenLogprob(t_text, v, b, offset, top_e))
            offset += len(t_text)
        return out

    def stream_batch(self, prompts: list[str], params: list[SamplingParams],
                     subsets: list[dict | None] | None = None, checked: bool = False) -> "BatchStream":
        """Requests decoding together, one step per `next()` (the worker's batches). `subsets`: each row's PARSE
        rank subset (`rank_subset` or the rank cache's), required on a PARSE model, None on a static one;
        `checked`: each came from `rank_subset` or `parse.validate` already (a 7B subset holds ~330 K indices)."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        subsets = subsets if subsets is not None else [None] * len(prompts)
        rows = [_Row(self.encode_prompt(p, sp), sp, self.eos) for p, sp in zip(prompts, params)]
        if self.routers is None:
            if any(s is not None for s in subsets):
                raise ValueError("this model has no PARSE rank experts; it cannot take a rank subset")
            return BatchStream(rows, self._decode(rows, None))
        if any(s is None for s in subsets):
            raise ValueError("a PARSE model's batch needs every row's rank subset (Engine.rank_subset)")
        return BatchStream(rows, self._decode(rows, None, subsets if checked else
                                              [validate(s, self.routers) for s in subsets]))

    def _fast_decoder(self, B: int, S: int, subsets: list[dict] | None = None) -> FastDecoder | None:
        """The thin decode path for (B, S), built once per batch size and cache-length bucket; None = eager."""
        mode = self.fast_path
        if mode == "auto":
            mode = "triton" if self.device.type == "cuda" else "off"
        if mode == "off":
            return None
        S = min(max(256, 1 << (S - 1).bit_length()), self.max_seq_len)  # power-of-two buckets: few graphs
        graph = "step" if self.device.type == "cuda" else "none"  # whole-step graph: measured fastest
        if subsets is not None:  # PARSE: rank slots per (B, S), loaded with this batch's subsets (no recapture)
            if (B, S) not in self._slots:
                self._make_room(B, S, parse=True)
                self._slots[(B, S)] = ParseSlots(self.model, self.routers,
                                                 DecodeConfig(batch_size=B, max_seq_len=S, backend=mode, graph=graph),
                                                 align=GPU_ALIGN if self.device.type == "cuda" else 1)
                sm = self._slots[(B, S)].model
                self._held[("slots", B, S)] = _cache_bytes(self._slots[(B, S)].decoder) + sum(
                    p.numel() * p.element_size() for p in sm.parameters())
            self._held.move_to_end(("slots", B, S))
            self._slots[(B, S)].load(subsets)
            return self._slots[(B, S)].decoder
        if (B, S) not in self._decoders:
            self._make_room(B, S, parse=False)
            dcfg = DecodeConfig(batch_size=B, max_seq_len=S, backend=mode, graph=graph, greedy=True)
            self._decoders[(B, S)] = FastDecoder(self.model, dcfg, packed=self._packed.get(dcfg.fused()))
            self._packed[dcfg.fused()] = self._decoders[(B, S)].layers  # decoders of one layout share one copy
            self._held[("dec", B, S)] = _cache_bytes(self._decoders[(B, S)])
        self._held.move_to_end(("dec", B, S))
        return self._decoders[(B, S)]

    def _make_room(self, B: int, S: int, parse: bool) -> None:
        """Drop the least recently used decoders until one more for (B, S) fits in `decoder_memory_bytes`: its KV
        cache, plus for PARSE slots the largest slots entry held so far (their weights are known once built)."""
        if self.decoder_memory_bytes is None:
            return
        cfg = self.cfg
        need = 2 * cfg.num_hidden_layers * B * (S + 1) * cfg.num_key_value_heads * cfg.head_dim * \
            self.model.embed.weight.element_size()
        if parse:
            need += max((b for (kind, _, _), b in self._held.items() if kind == "slots"), default=0)
        freed = False
        while self._held and sum(self._held.values()) + need > self.decoder_memory_bytes:
            kind, b, s = next(iter(self._held))
            del self._held[(kind, b, s)]
            (self._slots if kind == "slots" else self._decoders).pop((b, s))
            freed = True
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dropped caches and graph pools go back to the device

    def rank_subset(self, prompt: str) -> dict | None:
        """PARSE rank subset the routers choose for `prompt` (one extra prefill); None without PARSE routers."""
        if self.routers is None:
            return None
        return select(self.model, self.routers, self.encode_prompt(prompt))

    # --- the loop --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode(self, rows: list[_Row], subset: dict | None,
                routed: list[dict] | None = None) -> Iterator[list[tuple[int, str]]]:
        if subset is not None and self.routers is None:
            raise ValueError("this model has no PARSE rank experts; it cannot take a rank subset")
        if len(rows) > self.max_batch_size:
            raise ValueError(f"batch of {len(rows)} exceeds max_batch_size {self.max_batch_size}")
        if self.routers is None:
            yield from self._steps(rows)
            return
        # PARSE: `subset` (None: each row's own routed subset) masks the prefill and every decode step (rank reuse);
        # on the fast path the subsets are gathered into rank slots instead (workers/parse_decode.py)
        subsets = ([validate(subset, self.routers)] * len(rows) if subset is not None else
                   routed or [select(self.model, self.routers, r.prompt_ids) for r in rows])
        try:
            yield from self._steps(rows, subsets)
        finally:
            clear(self.model)

    def _steps(self, rows: list[_Row], subsets: list[dict] | None = None) -> Iterator[list[tuple[int, str]]]:
        B = len(rows)
        lens = [len(r.prompt_ids) for r in rows]
        budget = max(l + r.params.max_new_tokens for l, r in zip(lens, rows))
        S_max = min(budget, self.max_seq_len)
        cfg = self.cfg
        # finished rows keep stepping in the fast path, so its cache holds the longest prompt + the largest budget
        need = max(lens) + max(r.params.max_new_tokens for r in rows)
        # eager when a row may reach the context limit, and for PARSE with re-routing (subsets change mid-request)
        fast = need <= self.max_seq_len and not (self.routers is not None and self.reroute_every)
        # the fast path runs in a bucket's batch size (few decoders to build and hold); idle rows pad it: one token
        # each, stepping along unread (PARSE: the first row's subset, which adds nothing to the slots' union)
        B_run = next((b for b in BATCH_BUCKETS if b >= B), B) if fast else B
        run_subsets = None if subsets is None else subsets + [subsets[0]] * (B_run - B)
        dec = self._fast_decoder(B_run, need, run_subsets) if fast else None
        if dec is None:
            B_run = B
        tokens = torch.zeros(B_run, max(lens), dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, :lens[b]] = torch.tensor(r.prompt_ids)
        tokens[B:, 0] = rows[0].prompt_ids[0]
        lengths = torch.tensor(lens + [1] * (B_run - B), dtype=torch.int32, device=self.device)
        if dec is None and subsets is not None:  # eager PARSE: mask the pool (the fast path gathered slots instead)
            apply(self.model, subsets)
        if dec is not None:
            logits = dec.prefill(tokens.to(self.device), lengths)  # (B_run, V)
        else:
            cache = KVCache(cfg.num_hidden_layers, B, S_max, cfg.num_key_value_heads, cfg.head_dim,
                            device=self.device, dtype=self.model.embed.weight.dtype)
            logits = self.model(tokens.to(self.device), cache, lengths, last_only=True)  # (B, V)
        pos = list(lens)
        n_steps = 0  # tokens generated per row so far (PARSE re-routing)
        chosen = None  # greedy rows after a fast-path step: the argmax the step took on the device (one sync)
        while True:
            step = []
            for b, r in enumerate(rows):
                if r.finish is not None:
                    step.append((-1, ""))
                    continue
                if chosen is not None and r.params.temperature == 0:
                    t = chosen[b]
                else:
                    t = sample(logits[b], r.params, r.gen)
                if r.params.logprobs is not None:
                    r.logprob(logits[b], t, self.tokenizer)
                pos[b] += 1
                step.append((t, r.push(t, self.tokenizer, last=pos[b] >= S_max)))  # last: out of context
            yield step
            if all(r.finish is not None for r in rows):
                return
            nxt = torch.tensor([[max(t, 0)] for t, _ in step] + [[0]] * (B_run - B), dtype=torch.long,
                               device=self.device)
            if dec is not None:  # static shapes: every row steps (a finished row's tokens are ignored)
                logits = dec.step(nxt[:, 0])
                if dec.dcfg.greedy and any(r.finish is None and r.params.temperature == 0 for r in rows):
                    chosen = dec.tokens.tolist()
                continue
            n_steps += 1
            if self.reroute_every and self.routers is not None and n_steps % self.reroute_every == 0:
                apply(self.model, [select(self.model, self.routers, r.prompt_ids + r.ids) for r in rows])
            active = torch.tensor([r.finish is None for r in rows], dtype=torch.int32, device=self.device)
            logits = self.model(nxt, cache, active, last_only=True)  # finished rows: length 0, cache untouched


class BatchStream:
    """Rows decoding together (`Engine.stream_batch`). Each `next()` runs one step and returns one entry per row:
    its `StreamEvent`, or None once the row has finished. `stop(i, reason)` ends row i before the next step (a
    request cancelled or past its deadline) while the others go on; iteration ends when every row has finished."""

    def __init__(self, rows: list[_Row], steps: Iterator[list[tuple[int, str]]]) -> None:
        self.rows, self._steps = rows, steps

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> list[StreamEvent | None]:
        step = next(self._steps)
        return [None if t < 0 else
                StreamEvent(t, text, r.finish, r.new_logprobs() if r.params.logprobs is not None else None)
                for (t, text), r in zip(step, self.rows)]

    def stop(self, i: int, reason: str) -> None:
        if self.rows[i].finish is None:
            self.rows[i].finish = reason

    def close(self) -> None:
        self._steps.close()


def _cache_bytes(dec: FastDecoder) -> int:
    """Bytes of a decoder's KV cache (its own; packed weights are shared and not counted)."""
    return dec.cache._k.numel() * dec.cache._k.element_size() * 2
