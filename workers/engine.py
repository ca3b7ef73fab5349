"""Engine: prompts in, tokens out. Holds one model, its tokenizer and the generation loop.

generate → rows join a batch (`_Batch`) → each step: finished rows leave, joining rows are prefilled into free
slots of the dense KV cache, every row decodes one token, until each hits EOS, a stop token or string, or its
token budget. Rows join and leave between steps (continuous batching: `stream_batch` + `BatchStream.add`).
A PARSE checkpoint masks each row's rank components once at prefill and keeps them for every decode step of the
request (rank reuse; `workers/parse.py`).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from rankserve.workers.align import GPU_ALIGN, pad_ranks
from rankserve.workers.checkpoint import Manifest, load_checkpoint
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder, auto_one_launch
from rankserve.workers.host import upload
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import FactorizedLinear, Transformer
from rankserve.workers.parse import Routers, apply, clear, load_parse, route_scores, select, validate
from rankserve.workers.parse_batching import component_cost, group_by_overlap, membership, select_together
from rankserve.workers.parse_decode import ParseSlots
from rankserve.workers.prefill_graph import MIN_BUCKET, ChunkedPrefill, PrefillGraphs, pool_bytes
from rankserve.workers.prefix_cache import PrefixCache
from rankserve.workers.sampler import MAX_LOGPROBS, SamplingParams, sample
from rankserve.workers.tokenizer import Tokenizer


BATCH_BUCKETS = (1, 2, 4, 8)  # the fast path's batch sizes: a batch runs in the next one up, padded with idle rows
# joining rows prefilled one by one from CUDA graphs (workers/prefill_graph.py) up to this many at once, more in one
# eager forward: on the H200 at the 7B shape a replay takes 8-9 ms for <= 128 tokens and the eager forward 26-43 ms
# for one row, ~45 ms for 8 (host-bound; bench/results/continuous-h200.md)
PREFILL_GRAPH_ROWS = 4
Prompt = str | list[int]  # a text (BOS added) or token ids (used as given)
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
        # the text decoded so far (`_text`): of the tokens up to position `_read` of context + ids, whole characters;
        # the next decode starts at `_start`, the tokens before `_read` that lend the new ones their leading space
        self._done, self._start, self._read = "", 0, len(self.context)
        self.logprobs: list[TokenLogprob] = []  # one per token pushed (stop tokens included), when asked for
        self.logprobs_sent = 0  # entries handed out by `new_logprobs`
        self.cut = False  # ended on a stop string (the text was cut)
        self.text_len = 0  # characters of the generated tokens' text (before any cut): the next token's offset
        # its place in a batch (`_Batch`): slot, PARSE subset, the token to feed next, the logits (and on the fast
        # path the device's argmax) its next token comes from, tokens in its context, cache positions it may fill
        self.slot = -1
        self.subset: dict | None = None
        self.fed: int | None = None
        self.logits: torch.Tensor | None = None  # (V,)
        self.pick: int | None = None
        self.pos = len(prompt_ids)
        self.need = 0
        self.filled = 0  # prompt tokens in the cache: the row decodes once all are (a long one fills by chunks)
        self.prefix: tuple[int, torch.Tensor, torch.Tensor] | None = None  # a prefix cache hit: (p, K, V of ids[:p])

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
        """The generated tokens' text, decoded after the prompt's last tokens (a leading space survives). Decoded
        incrementally: only the tokens since the last whole character, after the ones before it. Decoding every token
        again each step cost 3.2 ms a token over the last 1,000 of 16,384 (the reference model's tokenizer on a 2-core
        CPU), more than a 7B decode step on the H200; this way 0.012 ms (bench/text_host.py)."""
        c = len(self.context)
        window = self.context[self._start:] + self.ids if self._start < c else self.ids[self._start - c:]
        head, full = tok.decode(window[:self._read - self._start]), tok.decode(window)
        if not full.startswith(head):  # the earlier tokens' text changed with the new ones: decode everything
            return whole_text(tok, self.context, self.ids)
        tail = full[len(head):]
        if tail and not tail.endswith("\ufffd"):  # whole characters: the next decode starts after them
            self._done += tail
            # not from tokens that read "" alone: SentencePiece drops a text's leading "▁" pieces (their spaces lost)
            if tok.decode(window[self._read - self._start:]):
                self._start = self._read
            self._read = c + len(self.ids)
            return self._done
        return self._done + tail

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


def whole_text(tok: Tokenizer, context: list[int], ids: list[int]) -> str:
    """`ids`' text decoded after the tokens `context` (so a leading space survives), all of it at once."""
    whole, before = tok.decode(context + ids), tok.decode(context)
    return whole[len(before):] if whole.startswith(before) else tok.decode(ids)


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
                 reroute_every: int = 0,  # PARSE: re-run the routers every N generated tokens; 0 = never (the default:
                 # choosing from the tokens just generated lost at every interval, parse-log.md, session 31)
                 # PARSE, generate_batch: route each batch together (workers/parse_batching.select_together): on the
                 # reference model 0.2 cut a batch of 8's union from 1.18 K to 1.02 K and lowered perplexity
                 # (477 -> 472; parse-log.md); 0 = every request its own routers' top-K
                 parse_pull: float = 0.2,
                 extra_eos: tuple[int, ...] = (),  # more ids that end a reply (generation_config.json's)
                 # bytes the fast path's decoders (KV caches, PARSE slot weights) may hold together, with the one-row
                 # prefill caches and their graphs' memory pools once built (they stay: they shrink what the decoders
                 # may hold); the least recently used decoders go first. None: 40 % of the GPU's memory (unbounded on
                 # the CPU)
                 decoder_memory_bytes: int | None = None,
                 # a prompt longer than this joins a batch whose rows are decoding this many tokens a step (they take
                 # a step between its chunks instead of waiting for the whole prompt); 0: whole prompts. None: 512,
                 # but 0 for PARSE on the GPU, whose joins reload the rank slots and whose chunks run eagerly: there
                 # chunks of 512 raised the worst stall (97 -> 123 ms) and cost 39 % of the tokens/s
                 # (bench/results/parse-joins-h200.md)
                 prefill_chunk: int | None = None,
                 # bytes of earlier prompts' K/V kept for prompts that start alike (workers/prefix_cache.py; static
                 # models): None: 5 % of the GPU's memory, 256 MB on the CPU; 0: off
                 prefix_cache_bytes: int | None = None,
                 # PARSE fast path: a joining prompt up to this many tokens is prefilled by a one-row CUDA graph over
                 # the rank slots (ParseSlots.prefill), a longer one eagerly; 0: always eagerly
                 parse_graph_tokens: int = 1024) -> None:
        if parse_pull < 0:
            raise ValueError(f"parse_pull must be >= 0, got {parse_pull}")
        if prefill_chunk is None:
            prefill_chunk = 0 if routers is not None and model.embed.weight.device.type == "cuda" else 512
        if parse_graph_tokens < 0:
            raise ValueError(f"parse_graph_tokens must be >= 0 (0: no graphs), got {parse_graph_tokens}")
        self.parse_graph_tokens = parse_graph_tokens
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
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
        self._prefills: PrefillGraphs | None = None  # the fast path's one-row prefills (CUDA graphs on the GPU)
        self._slot_stage: KVCache | None = None  # PARSE: the slots models' one-row prefills' shared staging cache
        self._slot_pool: tuple | None = None  # and their graphs' shared memory pool
        self.prefill_chunk = prefill_chunk
        self._chunks: ChunkedPrefill | None = None  # long prompts joining a decoding batch, a chunk a step
        self._holder: weakref.ref[_Batch] | None = None  # the open batch using the decoders and `_chunks` (_Batch)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = int(0.05 * torch.cuda.get_device_properties(self.device).total_memory) \
                if self.device.type == "cuda" else 256 * 2**20
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0: off), got {prefix_cache_bytes}")
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and routers is None else None
        # free places a running batch needs before waiting requests join it (BatchStream.admits): 1, except PARSE on
        # the GPU, where each join reloads the rank slots: at the 7B shape joining one at a time gave 1.11-1.13x
        # static batches' tokens/s, four at a time 1.33x (bench/results/parse-joins-h200.md)
        self.join_min = max(1, max_batch_size // 2) if routers is not None and self.device.type == "cuda" else 1

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
             max_batch_size: int = 8, max_seq_len: int | None = None, fast_path: str = "auto",
             reroute_every: int = 0, parse_pull: float = 0.2, decoder_memory_bytes: int | None = None,
             prefill_chunk: int | None = None, prefix_cache_bytes: int | None = None,
             parse_graph_tokens: int = 1024) -> "Engine":
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        model, manifest = load_checkpoint(model_dir, device=device, dtype=dtype)
        routers = load_parse(model_dir, model)  # checks the stored ranks: before padding
        if model.embed.weight.device.type == "cuda":
            pad_ranks(model, GPU_ALIGN)  # exact; aligned rows for cuBLAS and Triton (workers/align.py)
        return cls(model, Tokenizer.load(model_dir), manifest, max_batch_size, max_seq_len, fast_path,
                   routers=routers, reroute_every=reroute_every, parse_pull=parse_pull,
                   extra_eos=generation_eos(model_dir), decoder_memory_bytes=decoder_memory_bytes,
                   prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes,
                   parse_graph_tokens=parse_graph_tokens)

    # --- public API ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, params: SamplingParams | None = None, room: int = 1) -> list[int]:
        """The prompt's ids: a text's with BOS first, token ids as given (no BOS added: send it if the model wants
        it, as with OpenAI's and vLLM's token prompts); refused when empty, when an id has no token, or when it
        leaves fewer than `room` positions of the context (1: the first generated token; 0: scoring it alone)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, bos=True)
        else:
            ids = self.check_ids(prompt)
        if not ids and isinstance(prompt, str):
            raise ValueError("the prompt is empty and this tokenizer adds no BOS token: give at least one token")
        if not ids:
            raise ValueError("the prompt has no token ids (none is added to ids): give at least one, e.g. BOS")
        if len(ids) + room > self.max_seq_len:
            raise ValueError(f"prompt is {len(ids)} tokens; the context limit is {self.max_seq_len} tokens" +
                             (" for the prompt and its first generated token" if room else "") +
                             f": shorten it by {len(ids) + room - self.max_seq_len}")
        return ids

    def check_ids(self, ids: list[int]) -> list[int]:
        """Token ids of a prompt sent as ids: each a token of this model's tokenizer (and embedding), else
        ValueError naming the first that is not."""
        n = min(self.tokenizer.vocab_size, self.cfg.vocab_size)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                raise ValueError(f"token id {t!r} at position {i} is not a token of this model (ids 0..{n - 1})")
        return list(ids)

    def decode_prompt(self, ids: list[int]) -> str:
        """The text of a prompt sent as token ids (what echo returns and the rank cache embeds); checked as
        `check_ids`. BOS and EOS write no text."""
        return self.tokenizer.decode(self.check_ids(ids))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, subset: dict | None = None) -> GenerationResult:
        return self.generate_batch([prompt], [params or SamplingParams()], subset)[0]

    def generate_batch(self, prompts: list[Prompt], params: list[SamplingParams],
                       subset: dict | None = None) -> list[GenerationResult]:
        """Results in the prompts' order. More prompts than max_batch_size join the running batch in order as
        rows end; with PARSE routers (and no common `subset`) batches are instead formed by subset overlap
        (workers/parse_batching.py) and run one after another."""
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
        common = self._row_subset(subset, False) if subset is not None else None  # refused on a static model
        if routed is None:  # one running batch: rows join as others end (continuous batching)
            self._run_rows(rows, None if common is None else [common] * len(rows))
        else:  # PARSE batches by overlap, each routed together: one after another
            for g in groups:
                self._run_rows([rows[i] for i in g], [routed[i] for i in g])
        return [GenerationResult(r.released, r.ids, len(r.prompt_ids), r.finish or "length",
                                 r.released_logprobs() if r.params.logprobs is not None else None) for r in rows]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, subset: dict | None = None) -> Iterator[StreamEvent]:
        """Yield one event per generated token; closing the generator cancels the request."""
        params = params or SamplingParams()
        row = _Row(self.encode_prompt(prompt, params), params, self.eos)
        if subset is None and self.routers is not None:
            subset = select(self.model, self.routers, row.prompt_ids)
        batch = _Batch(self)
        batch.add(row, self._row_subset(subset, False) if subset is not None else None)
        try:
            while step := batch.step():
                (_, token, delta), = step
                yield StreamEvent(token, delta, row.finish,
                                  row.new_logprobs() if row.params.logprobs is not None else None)
        finally:
            batch.close()

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: Prompt, top: int = 0, subset: dict | None = None) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the tokens before it, and the `top` most likely tokens at its
        position (one teacher-forced forward; OpenAI's `echo` with `logprobs`). The BOS the engine prepends has no
        entry; without a BOS the first token has no context and its logprob is None. `offset` counts characters
        of the tokens' own text from the prompt's start. PARSE: scored with `subset` (None: the routers' choice)."""
        if not 0 <= top <= MAX_LOGPROBS:
            raise ValueError(f"top must be in [0, {MAX_LOGPROBS}], got {top}")
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

    def stream_batch(self, prompts: list[Prompt], params: list[SamplingParams],
                     subsets: list[dict | None] | None = None, checked: bool = False) -> "BatchStream":
        """Requests decoding together, one step per `next()`, rows numbered 0.. in order; more may join between
        steps (`BatchStream.add`). `subsets`: each row's PARSE rank subset (`rank_subset` or the rank cache's),
        required on a PARSE model, None on a static one; `checked`: each came from `rank_subset` or
        `parse.validate` already (a 7B subset holds ~330 K indices)."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} exceeds max_batch_size {self.max_batch_size}")
        subsets = subsets if subsets is not None else [None] * len(prompts)
        stream = BatchStream(self)
        for p, sp, sub in zip(prompts, params, subsets):
            stream.add(p, sp, sub, checked)
        return stream

    def _row_subset(self, subset: dict | None, checked: bool) -> dict | None:
        """A row's PARSE subset, validated unless `checked`; refused where the model takes none or needs one."""
        if self.routers is None:
            if subset is not None:
                raise ValueError("this model has no PARSE rank experts; it cannot take a rank subset")
            return None
        if subset is None:
            raise ValueError("a PARSE model's batch needs every row's rank subset (Engine.rank_subset)")
        return subset if checked else validate(subset, self.routers)

    def _fast_decoder(self, B: int, S: int, subsets: list[dict] | None = None) -> FastDecoder | None:
        """The thin decode path for (B, S), built once per batch size and cache-length bucket; None = eager."""
        mode = self.fast_path
        if mode == "auto":
            mode = "triton" if self.device.type == "cuda" else "off"
        if mode == "off":
            return None
        S = self._span(S)  # power-of-two buckets: few graphs
        graph = "step" if self.device.type == "cuda" else "none"  # whole-step graph: measured fastest
        if subsets is not None:  # PARSE: rank slots per (B, S), loaded with this batch's subsets (no recapture)
            if (B, S) not in self._slots:
                self._make_room(B, S, parse=True)
                self._slots[(B, S)] = ParseSlots(self.model, self.routers,
                                                 DecodeConfig(batch_size=B, max_seq_len=S, backend=mode, graph=graph),
                                                 align=GPU_ALIGN if self.device.type == "cuda" else 1)
                sm = self._slots[(B, S)].model
                self._held[("slots", B, S)] = self._slots[(B, S)].decoder.cache.nbytes() + sum(
                    p.numel() * p.element_size() for p in sm.parameters())
                self._slots[(B, S)].prefills = self._slot_prefills(sm)
            self._held.move_to_end(("slots", B, S))
            self._slots[(B, S)].load(subsets)
            return self._slots[(B, S)].decoder
        if (B, S) not in self._decoders:
            self._make_room(B, S, parse=False)
            # decided before packing: the one-launch steps fold the norms (decoders of B = 1..16 then share a pack)
            dcfg = auto_one_launch(DecodeConfig(batch_size=B, max_seq_len=S, backend=mode, graph=graph, greedy=True),
                                   self.model)
            self._decoders[(B, S)] = FastDecoder(self.model, dcfg, packed=self._packed.get(dcfg.fused()))
            self._packed[dcfg.fused()] = self._decoders[(B, S)].layers  # decoders of one layout share one copy
            self._held[("dec", B, S)] = self._decoders[(B, S)].cache.nbytes()
        self._held.move_to_end(("dec", B, S))
        return self._decoders[(B, S)]

    def _slot_prefills(self, model: Transformer) -> PrefillGraphs:
        """One-row prefills over a PARSE slots model (ParseSlots.prefill): CUDA graphs on the GPU, where the eager
        forward's host time (~55 ms at the 7B shape, whatever the prompt's length) stalled every join. All slots
        models' graphs share one staging cache and one memory pool (they run one at a time); the staging cache and
        the pool count against decoder_memory_bytes (_prefill_bytes), as a static model's prefill graphs' (whose
        buckets share one pool of their own)."""
        cuda = self.device.type == "cuda"
        if cuda and self._slot_pool is None:
            self._slot_pool = torch.cuda.graph_pool_handle()
        graphs = PrefillGraphs(model, self.max_seq_len, graph=cuda, stage=self._slot_stage, pool=self._slot_pool)
        self._slot_stage = graphs.stage  # the first one's, shared by the rest
        return graphs

    def _prefill_graphs(self) -> PrefillGraphs | None:
        """One-row prefills for the fast path of a static model: CUDA graphs on the GPU (the eager forward's host
        time, 26-43 ms at the 7B shape, otherwise stalls the running rows each time a request joins), the same
        padded forward run eagerly on the CPU. Built on first use; None for PARSE (masks differ per row)."""
        if self.routers is not None:
            return None
        if self._prefills is None:
            self._prefills = PrefillGraphs(self.model, self.max_seq_len, graph=self.device.type == "cuda")
        return self._prefills

    def _chunked_prefill(self) -> ChunkedPrefill:
        """The one-row fill cache long prompts are prefilled into a chunk at a time (built on first use; counted in
        decoder_memory_bytes); its chunks replay a CUDA graph for a static model on the GPU."""
        if self._chunks is None:
            self._chunks = ChunkedPrefill(self.model, self.max_seq_len,
                                          graph=self.device.type == "cuda" and self.routers is None)
        return self._chunks

    def _prefill_bytes(self) -> int:
        """Bytes of the one-row prefills built so far: their caches (the prefill graphs' staging caches, static and
        PARSE slots, and the chunked prefill's fill cache, each a whole context: 1.07 GB at the 7B shape with 2,048
        positions, bf16) and their graphs' memory pools as they stand (prefill_graph.pool_bytes). They stay once
        built, so they come off what the decoders may hold."""
        caches = [self._prefills.stage if self._prefills is not None else None, self._slot_stage,
                  self._chunks.fill if self._chunks is not None else None]
        return sum(c.nbytes() for c in {id(c): c for c in caches if c is not None}.values()) + \
            pool_bytes(self._prefills.pool if self._prefills is not None else None, self._slot_pool,
                       self._chunks.pool if self._chunks is not None else None)

    def _make_room(self, B: int, S: int, parse: bool) -> None:
        """Drop the least recently used decoders until one more for (B, S) fits in `decoder_memory_bytes` beside the
        one-row caches: its KV cache, plus for PARSE slots the largest slots entry held so far (their weights are
        known once built)."""
        if self.decoder_memory_bytes is None:
            return
        cfg = self.cfg
        need = 2 * cfg.num_hidden_layers * B * (S + 1) * cfg.num_key_value_heads * cfg.head_dim * \
            self.model.embed.weight.element_size()
        if parse:
            need += max((b for (kind, _, _), b in self._held.items() if kind == "slots"), default=0)
        need += self._prefill_bytes()
        freed = False
        while self._held and sum(self._held.values()) + need > self.decoder_memory_bytes:
            kind, b, s = next(iter(self._held))
            del self._held[(kind, b, s)]
            (self._slots if kind == "slots" else self._decoders).pop((b, s))
            freed = True
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dropped caches and graph pools go back to the device

    def rank_subset(self, prompt: Prompt) -> dict | None:
        """PARSE rank subset the routers choose for `prompt` (one extra prefill); None without PARSE routers."""
        if self.routers is None:
            return None
        return select(self.model, self.routers, self.encode_prompt(prompt))

    # --- the loop --------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        """Batch size that n rows run in: the next of BATCH_BUCKETS, then multiples of 8, at most max_batch_size."""
        b = next((b for b in BATCH_BUCKETS if b >= n), -(-n // 8) * 8)
        return max(min(b, self.max_batch_size), n)

    def _span(self, need: int) -> int:
        """Cache length for rows needing `need` positions: power-of-two buckets from 256 (few decoders to build)."""
        return min(max(256, 1 << (need - 1).bit_length()), self.max_seq_len)

    def _run_rows(self, rows: list[_Row], subsets: list[dict] | None) -> None:
        """Decode `rows` to their ends in one batch, in order: up to max_batch_size at a time, the next joining as
        one ends (PARSE: `subsets`, one per row, validated)."""
        if self.routers is not None and subsets is None:
            raise ValueError("a PARSE model's rows each need a rank subset")
        batch, todo = _Batch(self), list(range(len(rows)))
        try:
            while True:
                while todo and batch.held() < self.max_batch_size:
                    i = todo.pop(0)
                    batch.add(rows[i], None if subsets is None else subsets[i])
                if not batch.step() and not todo:
                    return
        finally:
            batch.close()


class _Batch:
    """Rows decoding together, joining and leaving between steps (continuous batching).

    Each running row holds a slot of the decoder in use: on the fast path a `FastDecoder` (PARSE: `ParseSlots`)
    of a batch-size bucket (1, 2, 4, 8) and cache-length bucket; on the eager path the model with a `KVCache` of
    that size. One `step()`:
        free the slots of rows that finished → move to another bucket when the running and joining rows need one
        (their KV rows copied, running rows first) → one decode step for the running rows → prefill the joining
        rows into their slots → one chunk of the first filling row → sample each row's next token.
    A joining prompt longer than `Engine.prefill_chunk` while rows are decoding (or filling) becomes a filling row:
    it holds its slot and is prefilled a chunk a step (`ChunkedPrefill`, first come first served), then decodes.
    So does a prompt that starts like an earlier one (`Engine.prefix`): its K/V up to there come from the prefix
    cache and only the rest is run.
    A slot with no row steps along on the fast path (static shapes) and its writes are never read; its position
    is reset before it could run past the cache. PARSE rows keep their own subsets: the slots are reloaded with
    the new arrangement's union when rows join or move (no recapture), the eager path's masks re-applied.
    The engine's decoders and fill cache serve one open batch at a time (`_hold`); another runs eagerly meanwhile.
    """

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.owns, self.fast = False, False  # holds the engine's decoders and fill cache; decodes on the fast path
        self.slots: list[_Row | None] = []  # slot -> its row
        self.B, self.S = 0, 0  # the layout in use: batch-size bucket, cache length
        self.dec: FastDecoder | None = None  # fast path
        self.cache: KVCache | None = None  # eager path
        self.lens: list[int] = []  # host mirror of the cache's seqlens, per slot
        self.joining: list[_Row] = []
        self.filling: list[_Row] = []  # rows with slots whose long prompts go in a chunk a step, in order
        # eager PARSE: each projection with the batch's mask for it, re-installed before a step where they differ
        self.masks: list[tuple[FactorizedLinear, torch.Tensor | None]] | None = None
        self.moves = 0  # layout changes after the first (tests, benchmarks)
        self.prefills = 0  # prompts run (a twin's copied cache not counted)
        self.chunks = 0  # chunks of long prompts run (tests, benchmarks)
        self.picking: list[_Row] = []  # rows whose greedy pick of the last decode step is still on the device
        self._hold()

    def add(self, row: _Row, subset: dict | None) -> None:
        """Queue `row` (its subset validated) to join at the next step."""
        if self.held() >= self.e.max_batch_size:
            raise ValueError(f"the batch is full ({self.e.max_batch_size} rows)")
        row.subset = subset
        row.need = min(row.pos + row.params.max_new_tokens, self.e.max_seq_len)
        self.joining.append(row)

    def running(self) -> list[_Row]:
        """The rows decoding (in slots, not finished, a first token sampled)."""
        return [r for r in self.slots if r is not None and r.finish is None and r.fed is not None]

    def held(self) -> int:
        """Rows holding a slot or queued for one, unfinished: what counts against max_batch_size."""
        return sum(r is not None and r.finish is None for r in self.slots) + len(self.joining)

    @torch.inference_mode()
    def step(self) -> list[tuple[_Row, int, str]]:
        """One token for every running and joining row: (row, token, new text); [] once none is left."""
        e = self.e
        for s, r in enumerate(self.slots):  # rows that finished (or were stopped, filling or not) leave
            if r is not None and r.finish is not None:
                self.slots[s] = None
                self._reset([s])
        ready = [r for r in self.filling if r.finish is None and r.filled == len(r.prompt_ids)]  # placed last step
        self.filling = [r for r in self.filling if r.finish is None and r.filled < len(r.prompt_ids)]
        running = self.running()
        joining = [r for r in self.joining if r.finish is None]
        self.joining = []
        if not running and not joining and not self.filling and not ready:
            self._let_go()
            return []
        if not self.owns and all(r is None for r in self.slots) and not self.filling:
            self._hold()
        chunk = e.prefill_chunk
        busy = bool(running or self.filling or ready)  # rows that would wait for a long prompt's whole prefill
        if e.prefix is not None and self.owns:  # a hit fills through the fill cache
            for r in joining:
                p, k, v = e.prefix.match(r.prompt_ids)
                r.prefix = (p, k, v) if p else None
        long = [r for r in joining if r.prefix is not None or
                (self.owns and busy and chunk and len(r.prompt_ids) > chunk)]
        whole = [r for r in joining if all(r is not l for l in long)]
        self._arrange(running + self.filling + ready, joining)
        if self.masks is not None:  # eager PARSE: a prompt scored or routed between steps used the model's masks
            for lin, mask in self.masks:  # no walk of the modules, and a write only where one was changed (walk
                if lin.mask is not mask:  # and writes: 0.12 ms a step on our CPU for the bundled model's 35)
                    lin.mask = mask
        if running:
            self._decode_step(running)
        cache = self.dec.cache if self.dec is not None else self.cache
        for r in ready:  # the fast step advanced their slots too: back to their prompts' ends (no host sync)
            cache.seqlens[r.slot:r.slot + 1].fill_(len(r.prompt_ids))
            self.lens[r.slot] = len(r.prompt_ids)
        if whole:
            self._prefill(whole)
        self._read_picks()  # before the chunks: a chunk runs on the device after this step's tokens are read
        self.filling += long
        ready += self._fill(busy=bool(running or ready))
        out = []
        for r in sorted(running + whole + ready, key=lambda r: r.slot):
            if r.pick is not None and r.params.temperature == 0:
                t = r.pick  # the argmax the fast step took on the device
            else:
                t = sample(r.logits, r.params, r.gen)
            if r.params.logprobs is not None:
                r.logprob(r.logits, t, e.tokenizer)
            r.pos += 1
            out.append((r, t, r.push(t, e.tokenizer, last=r.pos >= e.max_seq_len)))  # last: out of context
            r.fed, r.pick, r.logits = t, None, None
        if e.reroute_every and e.routers is not None:  # eager PARSE: re-route a row every N of its tokens
            due = [r for r, _, _ in out if r.finish is None and r.ids and len(r.ids) % e.reroute_every == 0]
            for r in due:
                r.subset = select(e.model, e.routers, r.prompt_ids + r.ids)
            if due:
                self._apply_masks()
        return out

    def close(self) -> None:
        if self.e.routers is not None and self.dec is None:
            clear(self.e.model)
        self._let_go()

    # --- the engine's decoders and fill cache ---
    def _hold(self) -> None:
        """Take the engine's decoders (their KV caches) and chunked prefill's fill cache, which keep one batch's rows
        across steps, unless another open batch holds them (two streams read in turn): this one then runs eagerly,
        whole prompts (no prefix cache hits: they go through the fill cache), in a KV cache of its own. Called with
        no rows in slots; the next rows start a fresh layout (the decoders may have served another batch)."""
        holder = self.e._holder() if self.e._holder is not None else None
        self.owns = holder is None or holder is self
        if self.owns:
            self.e._holder = weakref.ref(self)
        self.fast = self.owns and not (self.e.routers is not None and self.e.reroute_every)  # re-routing: eager
        self.slots, self.B, self.S, self.dec, self.cache, self.lens = [], 0, 0, None, None, []
        self.masks = None  # an eager PARSE layout's, from before: _arrange applies the next one's if it is eager

    def _let_go(self) -> None:
        """No rows left (or closed): the decoders and fill cache go to whichever batch takes rows next."""
        if self.owns and self.e._holder is not None and self.e._holder() is self:
            self.e._holder = None
        self.owns = False

    # --- layout ---
    def _arrange(self, running: list[_Row], joining: list[_Row]) -> None:
        """Give the joining rows slots, in the bucket the rows need (moving the running rows when it changes)."""
        e = self.e
        n = len(running) + len(joining)
        B = e._bucket(n)
        S = e._span(max(r.need for r in running + joining))
        if B == self.B and S <= self.S:  # the layout holds them: stay (a smaller bucket or a longer cache moves)
            if not joining:
                return
            slots = list(self.slots)  # joiners take free slots; the running rows stay where they are
            free = iter([s for s, r in enumerate(slots) if r is None])
            for r in joining:
                slots[next(free)] = r
            B, S = self.B, self.S
        else:
            slots = running + joining + [None] * (B - n)
        subsets = None if e.routers is None else [(r or (running + joining)[0]).subset for r in slots]
        old = (self.dec.cache if self.dec is not None else self.cache) if self.B else None
        old_slot = {id(r): r.slot for r in running}
        if self.fast:
            self.dec = e._fast_decoder(B, S, subsets)  # PARSE: the slots loaded with this arrangement's union
        if self.dec is None and (B, S) != (self.B, self.S):
            cfg = e.cfg
            self.cache = KVCache(cfg.num_hidden_layers, B, S, cfg.num_key_value_heads, cfg.head_dim,
                                 device=e.device, dtype=e.model.embed.weight.dtype)
        if (B, S) != (self.B, self.S):
            new = self.dec.cache if self.dec is not None else self.cache
            new.reset()  # a decoder used before: stale positions in every slot
            old_lens, self.lens = self.lens, [0] * B
            moved = [(old_slot[id(r)], s) for s, r in enumerate(slots) if r is not None and id(r) in old_slot]
            if moved and old is not None:  # the running rows' KV, positions up to what they filled
                src = torch.tensor([a for a, _ in moved], device=e.device)
                dst = torch.tensor([b for _, b in moved], device=e.device)
                m = min(old.max_seq_len, S)
                new._k[:, dst, :m] = old._k[:, src, :m]
                new._v[:, dst, :m] = old._v[:, src, :m]
                new.seqlens[dst] = old.seqlens[src]
                for a, b in moved:
                    self.lens[b] = old_lens[a]
            self.moves += self.B > 0
        for s, r in enumerate(slots):
            if r is not None:
                r.slot = s
        self.slots, self.B, self.S = slots, B, S
        if self.dec is None and subsets is not None:
            self._apply_masks()

    def _apply_masks(self) -> None:
        """Eager PARSE: each slot's row's subset as its mask row (a free slot takes another row's: unread)."""
        first = next(r for r in self.slots if r is not None)
        apply(self.e.model, [(r or first).subset for r in self.slots])
        self.masks = [(lin, lin.mask) for lin in self.e.model.projections().values() if lin.factorized]

    def _reset(self, slots: list[int]) -> None:
        """Positions of slots with no row back to 0: a fast step advances them too."""
        cache = self.dec.cache if self.dec is not None else self.cache
        if slots and cache is not None:
            cache.seqlens[torch.tensor(slots, device=self.e.device)] = 0
            for s in slots:
                self.lens[s] = 0

    # --- compute ---
    def _decode_step(self, running: list[_Row]) -> None:
        """Feed each running row's last token; its next logits (fast path: and the device's argmax) on the row."""
        e, B = self.e, self.B
        nxt = torch.zeros(B, dtype=torch.long)
        for r in running:
            nxt[r.slot] = r.fed
        if self.dec is not None:
            # every slot steps: keep those with no row, or a row still filling (placed later), inside the cache
            idle = [s for s, r in enumerate(self.slots)
                    if (r is None or r.filled < len(r.prompt_ids)) and self.lens[s] >= self.S - 1]
            self._reset(idle)
            logits = self.dec.step(nxt)  # host tokens: one queued copy into the step's input; (B, V) a static buffer
            self.lens = [l + 1 for l in self.lens]
            if self.dec.dcfg.greedy and any(r.params.temperature == 0 for r in running):
                self.picking = running  # read once the step's whole prompts are queued too (_read_picks)
        else:
            active = torch.zeros(B, dtype=torch.int32)
            active[[r.slot for r in running]] = 1
            logits = e.model(upload(nxt, e.device)[:, None], self.cache, upload(active, e.device),
                             last_only=True)  # others: untouched
            for r in running:
                self.lens[r.slot] += 1
        for r in running:
            r.logits = logits[r.slot]

    def _read_picks(self) -> None:
        """The device's argmax of the last decode step for the rows that took it. The read waits for the device,
        so it comes after the step's whole prompts were queued behind the decode step (the device does not idle
        while the host prepares them)."""
        if self.picking:
            picks = self.dec.tokens.tolist()
            for r in self.picking:
                r.pick = picks[r.slot]
            self.picking = []

    def _prefill(self, joining: list[_Row]) -> None:
        """The joining rows' prompts into their slots. A row with the same prompt (and PARSE subset) as one before
        it, a request's n choices, copies that row's cache instead of running the prompt again."""
        leaders: list[_Row] = []
        twins: list[tuple[_Row, _Row]] = []
        for r in joining:
            twin = next((l for l in leaders if l.prompt_ids == r.prompt_ids and l.subset == r.subset), None)
            if twin is None:
                leaders.append(r)
            else:
                twins.append((r, twin))
        self._prefill_rows(leaders)
        cache = self.dec.cache if self.dec is not None else self.cache
        for r in joining:
            r.filled = len(r.prompt_ids)
        if self.e.prefix is not None:
            for r in leaders:
                self.e.prefix.store(r.prompt_ids, cache.k[:, r.slot], cache.v[:, r.slot])
        for r, twin in twins:
            n = len(r.prompt_ids)
            cache._k[:, r.slot, :n] = cache._k[:, twin.slot, :n]  # (layers, n, H_kv, D)
            cache._v[:, r.slot, :n] = cache._v[:, twin.slot, :n]
            cache.seqlens[r.slot] = n
            self.lens[r.slot] = n
            r.logits = twin.logits.clone()
        self.prefills += len(leaders)

    def _fill(self, busy: bool) -> list[_Row]:
        """Filling rows' prompts, first come first served, through the one-row fill cache: a prefix cache hit's K/V
        copied in first, then the rest by chunks (the last one padded to a power of two). Each prompt completed goes
        into its row's slot, and into those of filling rows with the same prompt and subset (n choices).
        `busy` (rows are making tokens this step): chunks up to `Engine.prefill_chunk` tokens in all (at least one),
        and the rows completed stay in `filling` to take their first token next step, so that no step waits for two
        chunks' worth (a chunk runs on the device after its step's tokens were read, and a first token sampled at once
        would wait for it too); -> []. Otherwise every filling row's whole prompt; -> the rows completed, to take
        their first token now."""
        e = self.e
        chunks, cache = e._chunked_prefill(), self.dec.cache if self.dec is not None else self.cache
        budget, spent, done = (e.prefill_chunk or None) if busy else None, 0, []
        while r := next((t for t in self.filling if t.filled < len(t.prompt_ids)), None):
            n = len(r.prompt_ids)
            if r.filled == 0 and r.prefix is not None:
                p, k, v = r.prefix
                chunks.fill._k[:, 0, :p].copy_(k)  # (layers, p, H_kv, D)
                chunks.fill._v[:, 0, :p].copy_(v)
                r.filled, r.prefix = p, None
            while r.filled < n:
                left = n - r.filled
                size = min(e.prefill_chunk or left, max(MIN_BUCKET, 1 << (left - 1).bit_length()))
                if budget is not None and spent and spent + size > budget:
                    break
                if e.routers is None:  # static: the fill graph (CUDA) or the model
                    logits = chunks.run(r.prompt_ids, r.filled, size)
                else:  # PARSE: the model in use, its masks narrowed to the row's slot
                    model = self.dec.model if self.dec is not None else e.model
                    with _mask_rows(model, r.slot, r.slot + 1):
                        logits = chunks.run(r.prompt_ids, r.filled, size, model=model)
                r.filled = min(n, r.filled + size)
                spent += size
                self.chunks += 1
            if r.filled < n:
                break
            twins = [t for t in self.filling if t is r or (t.filled < n and t.prompt_ids == r.prompt_ids and
                                                           t.subset == r.subset)]
            for t in twins:
                chunks.place(cache, t.slot, n)
                self.lens[t.slot] = n
                t.filled, t.logits, t.prefix = n, logits if t is r else logits.clone(), None
            if e.prefix is not None:
                e.prefix.store(r.prompt_ids, chunks.fill.k[:, 0], chunks.fill.v[:, 0])
            self.prefills += 1
            done += twins
        if busy:
            return []
        self.filling = [t for t in self.filling if all(t is not d for d in done)]
        return done

    def _prefill_rows(self, joining: list[_Row]) -> None:
        """Prompts into their rows' slots: replayed graphs one by one, or one forward per run of neighbouring
        slots."""
        e = self.e
        model = self.dec.model if self.dec is not None else e.model
        cache = self.dec.cache if self.dec is not None else self.cache
        slots = e._slots.get((self.B, self.S)) if e.routers is not None else None
        if self.dec is not None and len(joining) <= PREFILL_GRAPH_ROWS and (e.routers is None or slots is not None):
            for i, r in enumerate(joining):  # the fast path: one replayed graph a row
                if slots is None:
                    r.logits = e._prefill_graphs().prefill(r.prompt_ids, cache, r.slot)
                elif len(r.prompt_ids) <= e.parse_graph_tokens and \
                        (logits := slots.prefill(r.prompt_ids, cache, r.slot)) is not None:
                    r.logits = logits
                else:  # PARSE: a long prompt, or a union wider than the graphs read: this row and the rest eagerly
                    joining = joining[i:]
                    break
                self.lens[r.slot] = len(r.prompt_ids)
            else:
                return
        rows = sorted(joining, key=lambda r: r.slot)
        runs = [[rows[0]]]
        for r in rows[1:]:
            if r.slot == runs[-1][-1].slot + 1:
                runs[-1].append(r)
            else:
                runs.append([r])
        for run in runs:
            a, b = run[0].slot, run[-1].slot + 1
            lens = [len(r.prompt_ids) for r in run]
            tokens = torch.zeros(len(run), max(lens), dtype=torch.long)
            for i, r in enumerate(run):
                tokens[i, :lens[i]] = torch.tensor(r.prompt_ids)
            view = cache.rows(a, b)
            view.seqlens.zero_()
            with _mask_rows(model, a, b):
                logits = model(upload(tokens, e.device), view,
                               upload(torch.tensor(lens, dtype=torch.int32), e.device), last_only=True)  # (b - a, V)
            for i, r in enumerate(run):
                r.logits = logits[i]
                self.lens[r.slot] = lens[i]


class BatchStream:
    """Rows decoding together (`Engine.stream_batch`); more join between steps (`add`, continuous batching).
    Rows are numbered in the order they were added. Each `next()` runs one step and returns {row: StreamEvent} for
    the rows that made a token; a row that has finished is forgotten at the step after its last event.
    `stop(i, reason)` ends row i before the next step while the others go on; iteration ends when no row is left."""

    def __init__(self, engine: Engine) -> None:
        self.e, self._batch = engine, _Batch(engine)
        self.rows: dict[int, _Row] = {}  # the rows not yet finished (or finished at the last step)
        self._next_id = 0

    def add(self, prompt: Prompt, params: SamplingParams, subset: dict | None = None, checked: bool = False) -> int:
        """Queue a request to join at the next step; -> its row number. `subset`: its PARSE rank subset (required
        on a PARSE model, None on a static one); `checked`: it came from `rank_subset` or `parse.validate`.
        Raises ValueError for a bad prompt or subset, or when `room()` is 0."""
        row = _Row(self.e.encode_prompt(prompt, params), params, self.e.eos)
        self._batch.add(row, self.e._row_subset(subset, checked))
        self.rows[self._next_id] = row
        self._next_id += 1
        return self._next_id - 1

    def room(self) -> int:
        """How many more rows may join now."""
        return self.e.max_batch_size - self._batch.held()

    def admits(self, waiting: int) -> int:
        """How many of `waiting` requests should join now: as many as there is room for once the room holds
        `Engine.join_min` of them (or all of them, or no row is running); else 0, and the running rows go on."""
        room, want = self.room(), min(self.e.join_min, waiting)
        idle = self._batch.held() == 0
        return min(room, waiting) if idle or room >= want else 0

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> dict[int, StreamEvent]:
        for i in [i for i, r in self.rows.items() if r.finish is not None]:
            del self.rows[i]
        step = self._batch.step()
        if not step:
            raise StopIteration
        made = {id(r): (t, text) for r, t, text in step}
        return {i: StreamEvent(made[id(r)][0], made[id(r)][1], r.finish,
                               r.new_logprobs() if r.params.logprobs is not None else None)
                for i, r in self.rows.items() if id(r) in made}

    def stop(self, i: int, reason: str) -> None:
        r = self.rows.get(i)
        if r is not None and r.finish is None:
            r.finish = reason

    def close(self) -> None:
        self._batch.close()


@contextlib.contextmanager
def _mask_rows(model: Transformer, a: int, b: int) -> Iterator[None]:
    """PARSE masks (B, r) narrowed to rows a..b-1, for a prefill of those rows alone."""
    lins = model.projections()  # one walk of the modules (224 at the 7B shape), not one per projection
    saved = {n: lin.mask for n, lin in lins.items() if lin.factorized and lin.mask is not None}
    try:
        for n, m in saved.items():
            lins[n].mask = m[a:b]
        yield
    finally:
        for n, m in saved.items():
            lins[n].mask = m
