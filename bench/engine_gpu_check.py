"""GPU smoke check of the engine on the small models (the bundled stories260K, the reference model, and svd-llm
compressions of both): the fast decode path (per-kernel or one-launch) at B = 1 and 3 against the CPU fp32 engine,
logprobs against a teacher-forced forward, the cost of asking for logprobs, the worker's batches
(`Engine.stream_batch`: rows against each alone, 8 requests batched against one by one), continuous batching (rows
joining a running batch against each alone, PARSE rows too; a queue of mixed lengths, static batches against
joining), chunked prefill (the fill graph against eager chunks, a long prompt joining by chunks against it alone),
the prefix cache (prompts sharing a start against an engine without it) and echo scoring
(`Engine.prompt_logprobs` against the logprobs generation reported), and a PARSE pool with dense members on the rank
slots against the eager masked pool.

CI runs the kernels under TRITON_INTERPRET=1, where tl.dot takes any shape and there is no L2 prefetch: this check
is what found head_dim 8 failing to compile on the H200 (kernels/decode_attention.py, workers/fast_decode.py).

Run (GPU):  python -m rankserve.bench.engine_gpu_check --out bench/results/engine-gpu-check.json
Per model and batch: the first greedy token that differs from the CPU fp32 run (None: all 32 equal) with the CPU
top-2 margin there (a near-tie in bf16), the largest |logprob - teacher-forced log-softmax| (bf16 paths), the
logprob gap of greedy tokens that are not the top-1 entry (0: an exact tie between two ids), and ms/token of 64
tokens (prefill included, median of 5) without and with logprobs=5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rankserve.workers.engine import Engine
from rankserve.workers.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
STORY_PROMPTS = ["Once upon a time", "Lily", "The dog"]
WIKI_PROMPTS = ["The history of the city", "It was", "A"]


def compress(src: Path, out: Path, keep: float, calib_tokens: int) -> Path:
    subprocess.run([sys.executable, "-P", "-m", "rankserve.cli", "compress", "--method", "svd-llm", "--keep", str(keep),
                    "--calib", str(ROOT / "tests" / "data" / "tinyshakespeare-head.txt"), "--calib-tokens",
                    str(calib_tokens), str(src), str(out)], check=True)
    return out


def check(model_dir: Path, prompts: list[str], n: int = 32) -> dict:
    gpu, cpu = Engine.load(model_dir, device="cuda"), Engine.load(model_dir)
    res: dict = {}
    for B in (1, 3):
        sps = [SamplingParams(max_new_tokens=n, logprobs=3, ignore_eos=True) for _ in range(B)]
        rs, ref = gpu.generate_batch(prompts[:B], sps), cpu.generate_batch(prompts[:B], sps)
        r = rs[0]
        ids = gpu.encode_prompt(prompts[0], sps[0]) + r.token_ids
        with torch.no_grad():  # teacher-forced: the steps that chose each generated token
            lp = torch.log_softmax(gpu.model(torch.tensor([ids], device="cuda"))[0].double(), -1)[len(ids) - n - 1:-1]
        got = torch.tensor([l.logprob for l in r.logprobs], dtype=torch.float64, device="cuda")
        want = lp[torch.arange(n, device="cuda"), torch.tensor(r.token_ids, device="cuda")]
        first = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), None)
                 for x, y in zip(rs, ref)]
        res[f"B{B}"] = dict(
            first_mismatch_vs_cpu_fp32=first,
            cpu_top2_margin_at_first_mismatch=[None if i is None else round(y.logprobs[i].top[0][1] -
                                                                           y.logprobs[i].top[1][1], 5)
                                               for i, y in zip(first, ref)],
            max_abs_logprob_diff_vs_forward=float((got - want).abs().max()),
            greedy_not_top1_logprob_gaps=[round(l.top[0][1] - l.logprob, 6) for x in rs for l in x.logprobs
                                          if l.token != l.top[0][0]],
            text=r.text[:60])
    times = {}
    for k in (None, 5):
        ts = []
        for _ in range(5):
            p = SamplingParams(max_new_tokens=64, logprobs=k, ignore_eos=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gpu.generate(prompts[0], p)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / 64 * 1e3)
        times[f"logprobs={k}"] = round(statistics.median(ts), 4)
    res["ms_per_token_64_tokens_incl_prefill_median5"] = times
    res["one_launch"] = any(d.step_kernel is not None for d in gpu._decoders.values())
    res["stream_batch"] = check_stream_batch(gpu, prompts)
    res["continuous"] = check_continuous(gpu, prompts)
    res["prompt_logprobs"] = check_prompt_logprobs(gpu, prompts[0])
    return res


def check_open_streams(model_dir: Path, prompts: list[str], chunk: int = 16, dtype: torch.dtype | None = None) -> dict:
    """Two batches of one engine open at once, read in turn (session 35: the first holds the engine's decoders and
    fill cache, the other runs eagerly in its own cache): each row's greedy tokens against its request alone, with a
    long prompt joining each batch by chunks; and every row's streamed text (the events' pieces joined) against the
    tokenizer's decoding of its tokens. `dtype` None: bf16; in fp32 a mismatch is a fault, not a near-tie."""
    from rankserve.workers.engine import whole_text

    eng = Engine.load(model_dir, device="cuda", dtype=dtype, prefill_chunk=chunk, prefix_cache_bytes=0)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    longs = [" ".join(prompts * 6), " ".join(reversed(prompts * 6))]
    short = [prompts[0], prompts[1 % len(prompts)]]
    alone = [eng.generate(p, sp) for p in short + longs]
    a, b = eng.stream_batch([short[0]], [sp]), eng.stream_batch([short[1]], [sp])
    next(a), next(b)
    ka, kb = a.add(longs[0], sp), b.add(longs[1], sp)
    got = {(0, ka): [], (1, kb): []}
    text = {(0, ka): "", (1, kb): ""}
    while any(s.rows for s in (a, b)):
        for j, s in enumerate((a, b)):
            for i, ev in next(s, {}).items():
                if (j, i) in got:
                    got[(j, i)].append(ev.token_id)
                    text[(j, i)] += ev.text
    chunks = a._batch.chunks + b._batch.chunks
    a.close(), b.close()
    rows = list(got.values())
    return dict(first_mismatch_vs_alone=[next((i for i, (x, y) in enumerate(zip(r, w.token_ids)) if x != y), None)
                                         for r, w in zip(rows, alone[2:])],
                rows_tokens=[len(r) for r in rows], chunks=chunks,
                streamed_text_equal_decoded=[t == whole_text(eng.tokenizer, eng.encode_prompt(p, sp), r)
                                             for p, t, r in zip(longs, text.values(), rows)],
                next_stream_owns=bool(eng.stream_batch([short[0]], [sp])._batch.owns))


def check_stream_batch(gpu: Engine, prompts: list[str]) -> dict:
    """The worker's batches on the GPU: rows of different lengths, one stopped from outside at step 5, against each
    prompt alone (greedy; a bf16 batch may part from B = 1 at a near-tie); then 8 requests of 64 tokens one after
    another against one batch of 8 (what batching buys a replica)."""
    lens = [32, 20, 12][:len(prompts)]
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    alone = [gpu.generate(p, sp).token_ids for p, sp in zip(prompts, sps)]
    got: list[list[int]] = [[] for _ in prompts]
    batch = gpu.stream_batch(prompts, sps)
    for i, step in enumerate(batch):
        for j, ev in step.items():
            got[j].append(ev.token_id)
        if i == 4 and len(prompts) > 1:
            batch.stop(1, "cancelled")
    batch.close()
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(got, alone)]
    eight = [prompts[i % len(prompts)] for i in range(8)]
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)

    def timed(fn) -> float:
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    one_by_one = timed(lambda: [gpu.generate(p, sp) for p in eight])
    batched = timed(lambda: [None for _ in gpu.stream_batch(eight, [sp] * 8)])
    return dict(rows_tokens=[len(g) for g in got], first_mismatch_vs_alone=first,
                eight_requests_of_64_tokens_s=dict(one_by_one=round(one_by_one, 4), one_batch=round(batched, 4),
                                                   speedup=round(one_by_one / batched, 2)))


def run_joins(stream, joins: dict[int, tuple[str, SamplingParams, dict | None]], alone: list[list[int]]) -> dict:
    """Run a batch stream to its end, adding `joins[step]` (prompt, params, subset) before that step; -> each row's
    token count and first greedy token that differs from `alone` (rows in the order added; None: all equal)."""
    got: dict[int, list[int]] = {}
    step = 0
    while True:
        if step in joins:
            stream.add(*joins[step])
        try:
            events = next(stream)
        except StopIteration:
            break
        for i, ev in events.items():
            got.setdefault(i, []).append(ev.token_id)
        step += 1
    rows = [got.get(j, []) for j in range(len(alone))]
    return dict(rows_tokens=[len(r) for r in rows],
                first_mismatch_vs_alone=[next((i for i, (a, b) in enumerate(zip(r, want)) if a != b), None)
                                         for r, want in zip(rows, alone)])


def check_continuous(gpu: Engine, prompts: list[str], queue: int = 32, longest: int = 128) -> dict:
    """Continuous batching on the GPU. Rows joining a running batch (at steps 0, 3 and 9; the last one long enough
    to move the cache to 512 positions) against each prompt alone (greedy, first mismatch: bf16 batches may part
    at near-ties). Then `queue` requests of mixed lengths (uniform in [longest / 8, longest], seeded) served by
    up to 8 rows: static batches (8 at a time, each run to its longest row) against rows joining as others free
    their places; generated tokens / wall time and rows per step of each."""
    plan = [(prompts[0], 40, 0), (prompts[1 % len(prompts)], 12, 3), (prompts[2 % len(prompts)], 300, 9)]
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n, _ in plan]
    alone = [gpu.generate(p, sp).token_ids for (p, _, _), sp in zip(plan, sps)]
    stream = gpu.stream_batch([plan[0][0]], sps[:1])
    joins = dict(**run_joins(stream, {at: (p, sps[j], None) for j, (p, _, at) in enumerate(plan) if j}, alone),
                 moves=stream._batch.moves, cache_len=stream._batch.S)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, longest // 8), longest + 1, (queue,), generator=gen).tolist()
    reqs = [(prompts[i % len(prompts)], SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]

    def static() -> list[int]:
        rows = []
        for i in range(0, queue, 8):
            chunk = reqs[i:i + 8]
            rows += [len(step) for step in gpu.stream_batch([p for p, _ in chunk], [sp for _, sp in chunk])]
        return rows

    def continuous() -> list[int]:
        rows, todo = [], list(reqs)
        stream = gpu.stream_batch([], [])
        while True:
            while todo and stream.room():
                stream.add(*todo.pop(0))
            try:
                rows.append(len(next(stream)))
            except StopIteration:
                return rows

    out = {}
    for name, fn in (("static", static), ("continuous", continuous)):
        fn()  # warm-up: decoders of every bucket built
        ts, rows = [], []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows = fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        out[name] = dict(s=round(t, 4), tokens_per_s=round(sum(lengths) / t, 1), steps=len(rows),
                         mean_rows_per_step=round(sum(rows) / len(rows), 2))
    out["speedup"] = round(out["static"]["s"] / out["continuous"]["s"], 2)
    return dict(joins=joins, mixed_queue=dict(requests=queue, tokens=sum(lengths), **out))


def check_parse_joins(model_dir: Path, prompts: list[str]) -> dict:
    """PARSE rows with their own subsets joining a running batch on the GPU (the rank slots reloaded with each
    arrangement's union, the batch moved 1 -> 2 -> 4 rows), against each prompt alone with its subset."""
    gpu = Engine.load(model_dir, device="cuda")
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    subsets = [gpu.rank_subset(p) for p in prompts]
    alone = [gpu.generate(p, sp, s).token_ids for p, s in zip(prompts, subsets)]
    stream = gpu.stream_batch(prompts[:1], [sp], subsets[:1])
    got = run_joins(stream, {2: (prompts[1], sp, subsets[1]), 5: (prompts[2], sp, subsets[2])}, alone)
    return dict(**got, moves=stream._batch.moves,
                one_launch_at_b1=any(s.decoder.step_kernel is not None for s in gpu._slots.values()))


@torch.inference_mode()
def check_parse_dense_members(device: str = "cuda", steps: int = 6) -> dict:
    """A PARSE pool that keeps some projections dense (v beside routed q/k, up beside a routed gate, one o), random
    fp32 weights: the rank slots on the fast path (Triton, graphs where `device` has them) against the eager masked
    pool on the same device, B = 1 and 3, two loads of different subsets each (the second must be read, not the
    first's). Largest |logit difference| relative to the eager logits' largest entry, over the prefill and steps."""
    from rankserve.workers.config import ModelConfig
    from rankserve.workers.fast_decode import DecodeConfig
    from rankserve.workers.kv_cache import KVCache
    from rankserve.workers.model import PROJS, Transformer, proj_name
    from rankserve.workers.parse import Routers, apply, clear
    from rankserve.workers.parse_decode import ParseSlots

    cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    r_max = {"q": 96, "k": 48, "v": 64, "o": 112, "gate": 160, "up": 128, "down": 144}  # uneven
    dense = ("layers.0.attn.v", "layers.0.mlp.up", "layers.1.attn.o")
    torch.manual_seed(0)
    ranks = {proj_name(i, p): None if proj_name(i, p) in dense else r_max[p]
             for i in range(cfg.num_hidden_layers) for p in PROJS}
    pool = Transformer(cfg, ranks)
    for w in pool.parameters():
        w.copy_(torch.randn_like(w) * 0.05)
    pool = pool.to(device).eval()
    pools = {n: r for n, r in ranks.items() if r is not None}
    routers = Routers(R={}, b={}, k={n: r // 2 for n, r in pools.items()}, r_max=pools, head={}, perm={})
    graph = "step" if device == "cuda" else "none"
    out: dict = {}
    for B in (1, 3):
        slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=64, graph=graph))
        errs = []
        for seed in (0, 10):
            g = torch.Generator().manual_seed(seed)
            subsets = [{"v": 1, "k": {n: sorted(torch.randperm(pools[n], generator=g)[:k].tolist())
                                      for n, k in routers.k.items()}} for _ in range(B)]
            prompt = torch.randint(0, cfg.vocab_size, (B, 7), generator=g).to(device)
            toks = [torch.randint(0, cfg.vocab_size, (B,), generator=g).to(device) for _ in range(steps)]
            apply(pool, subsets)
            cache = KVCache(cfg.num_hidden_layers, B, 64, cfg.num_key_value_heads, cfg.head_dim, device=device)
            ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in toks]
            clear(pool)
            slots.load(subsets)
            got = [slots.decoder.prefill(prompt)] + [slots.decoder.step(t).clone() for t in toks]
            errs.append(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref, strict=True)))
        out[f"B{B}"] = dict(max_rel_err_per_load=errs, one_launch=slots.decoder.step_kernel is not None,
                            masked=slots.masked)
    return out


@torch.inference_mode()
def check_chunked(model_dir: Path, prompts: list[str], chunk: int = 64, device: str = "cuda",
                  dtype: torch.dtype | None = None) -> dict:
    """Chunked prefill on the GPU: one long prompt's chunks replayed from the fill graph against the same chunks run
    eagerly (last logits, K/V) and against one forward of the whole prompt, and a long prompt joining a decoding
    batch a chunk a step against each request alone (first greedy mismatch; `dtype` None: bf16)."""
    from rankserve.workers.prefill_graph import ChunkedPrefill

    gpu = Engine.load(model_dir, device=device, dtype=dtype, prefill_chunk=chunk, prefix_cache_bytes=0)  # chunks only
    long = " ".join(prompts * 80)
    ids = gpu.tokenizer.encode(long, bos=True)[: gpu.max_seq_len - 96]
    graphed = ChunkedPrefill(gpu.model, gpu.max_seq_len, graph=device == "cuda")
    eager = ChunkedPrefill(gpu.model, gpu.max_seq_len, graph=False)
    for start in range(0, len(ids), chunk):
        a, b = graphed.run(ids, start, chunk), eager.run(ids, start, chunk)
    n = len(ids)
    kv = max(float((graphed.fill.k[:, 0, :n] - eager.fill.k[:, 0, :n]).abs().max()),
             float((graphed.fill.v[:, 0, :n] - eager.fill.v[:, 0, :n]).abs().max()))
    whole = gpu.model(torch.tensor([ids], device=device), last_only=True)[0]  # one eager forward of the prompt
    text = gpu.tokenizer.decode(ids[1:])
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = [gpu.generate(prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids,
             gpu.generate(text, sp).token_ids]
    stream = gpu.stream_batch([prompts[0]], [SamplingParams(max_new_tokens=40, ignore_eos=True)])
    joined = run_joins(stream, {2: (text, sp)}, alone)
    return dict(prompt_tokens=n, chunk=chunk, graph_vs_eager_max_abs_logit=float((a - b).abs().max()),
                graph_vs_eager_max_abs_kv=kv, chunks_vs_whole_max_abs_logit=float((a - whole).abs().max()),
                chunks_argmax_equal_whole=int(a.argmax()) == int(whole.argmax()), **joined)


@torch.inference_mode()
def check_prefix(model_dir: Path, prompts: list[str], dtype: torch.dtype | None = None,
                 device: str = "cuda") -> dict:
    """Prefix cache on the GPU: prompts sharing a long start, after one that filled the cache, against an engine
    without it (first greedy mismatch of 24 tokens; `dtype` None: bf16), alone and joining a running batch."""
    eng, plain = (Engine.load(model_dir, device=device, dtype=dtype, prefix_cache_bytes=b) for b in (None, 0))
    shared = " ".join(prompts * 30)
    tails = [" and then", " but the", " so it was", " in the end"]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [plain.generate(shared + t, sp).token_ids for t in tails]
    eng.generate(shared, sp)  # fills the cache
    alone = [eng.generate(shared + t, sp).token_ids for t in tails[:2]]
    stream = eng.stream_batch([prompts[0]], [SamplingParams(max_new_tokens=40, ignore_eos=True)])
    joined = run_joins(stream, {1: (shared + tails[2], sp), 2: (shared + tails[3], sp)},
                       [plain.generate(prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids]
                       + want[2:])
    return dict(prompt_tokens=len(eng.encode_prompt(shared + tails[0])), hit_tokens=eng.prefix.hit_tokens,
                first_mismatch_alone=[next((i for i, (x, y) in enumerate(zip(a, w)) if x != y), None)
                                      for a, w in zip(alone, want)],
                first_mismatch_joined=joined["first_mismatch_vs_alone"], rows_tokens=joined["rows_tokens"])


def check_prompt_logprobs(gpu: Engine, prompt: str) -> dict:
    """echo scoring on the GPU: prompt + a generated completion, scored in one forward, against the logprobs the
    generation reported (bf16: the eager forward and the fast decode path round differently)."""
    gen = gpu.generate(prompt, SamplingParams(max_new_tokens=32, logprobs=3, ignore_eos=True))
    ids = gpu.tokenizer.encode(prompt)
    if gpu.tokenizer.encode(prompt + gen.text) != ids + gen.token_ids:
        return dict(round_trip=False)
    tail = gpu.prompt_logprobs(prompt + gen.text, 3)[len(ids) - 1:]
    return dict(round_trip=True, tokens_equal=[e.token for e in tail] == [e.token for e in gen.logprobs],
                max_abs_logprob_diff=round(max(abs(a.logprob - b.logprob) for a, b in zip(tail, gen.logprobs)), 5),
                top1_alternative_equal=sum(a.top[0][0] == b.top[0][0] for a, b in zip(tail, gen.logprobs)) / len(tail))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--only-chunked", action="store_true",
                   help="only the chunked-prefill, prefix-cache and open-streams checks of the reference models, bf16 "
                        "and fp32 (check_chunked, check_prefix, check_open_streams)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this check needs a CUDA GPU")
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"stories260K-svd-llm-0.8": (compress(ROOT / "models" / "stories260K", Path(tmp) / "s", 0.8, 32768),
                                              STORY_PROMPTS),
                  "reference-svd-llm-0.6": (compress(ROOT / "models" / "reference", Path(tmp) / "r", 0.6, 8192),
                                            WIKI_PROMPTS),
                  "reference": (ROOT / "models" / "reference", WIKI_PROMPTS),
                  "stories260K": (ROOT / "models" / "stories260K", STORY_PROMPTS)}
        for name, (d, prompts) in models.items():
            if not a.only_chunked:
                out[name] = check(d, prompts)
                print(name, json.dumps(out[name]), flush=True)
            if not name.startswith("reference") and not a.only_chunked:  # the references' run below, both dtypes
                out[name + "-open-streams"] = check_open_streams(d, prompts)
                print(name + "-open-streams", json.dumps(out[name + "-open-streams"]), flush=True)
            if name.startswith("reference"):
                for dt, tag in ((None, ""), (torch.float32, "-fp32")):
                    out[name + "-chunked" + tag] = check_chunked(d, prompts, dtype=dt)
                    out[name + "-prefix" + tag] = check_prefix(d, prompts, dtype=dt)
                    out[name + "-open-streams" + tag] = check_open_streams(d, prompts, dtype=dt)
                    for what in ("-chunked", "-prefix", "-open-streams"):
                        print(name + what + tag, json.dumps(out[name + what + tag]), flush=True)
        if a.only_chunked:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
            return 0
        from rankserve.compress.parse import TrainConfig, build_parse_checkpoint

        calib = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
        parse_dir = build_parse_checkpoint(ROOT / "models" / "stories260K", Path(tmp) / "p", keep=0.6,
                                           calib_text=calib, train_text=calib, steps=2, kd_steps=0,
                                           train=TrainConfig(windows=48, window=32, prompt_len=16, batch_size=16,
                                                             collect_batch=16),
                                           calib_tokens=2048, calib_seq_len=128, progress=False)
        out["stories260K-parse-joins"] = check_parse_joins(parse_dir, STORY_PROMPTS)
        print("stories260K-parse-joins", json.dumps(out["stories260K-parse-joins"]), flush=True)
        out["parse-dense-members"] = check_parse_dense_members()
        print("parse-dense-members", json.dumps(out["parse-dense-members"]), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
