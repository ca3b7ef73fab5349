"""Decode and prefill benchmark on a GPU: HF StaticCache baselines vs rankserve's runtime, one run, one GPU.

Random weights at the LLaMA-7B shape (speed does not depend on their values), bf16. Rows per case:
  hf-dense-eager       transformers LlamaForCausalLM + StaticCache, no compile (dense weights)
  hf-lowrank-eager     the same with every decoder linear replaced by two nn.Linear (V then U): the papers' baseline
  ours-eager           rankserve's Transformer.forward with its dense KV cache, no graphs
  ours-compile         our torch step under torch.compile(mode="reduce-overhead") (gpt-fast style; one case only)
  ours-torch-graph     our torch step captured as one CUDA graph (what the Triton kernels add is the gap to the next)
  ours-graph-layer     Triton kernels, one CUDA graph per layer
  ours-graph-step-triton   Triton kernels, one CUDA graph for the whole step (the engine's default: norms folded
                       into the GEMVs, residual adds in epilogues, programmatic dependent launch on Hopper)
  ours-step-nopdl      the same without programmatic dependent launch
  ours-step-unfused    separate RMSNorm(+residual) kernels, no PDL (12 kernels a layer: the previous design)
  ours-graph-step-cublas   the step with cuBLAS GEMVs inside the graph
Every figure: ms/token median of >= 5 repeats (min/max too), tok/s, bytes read per token (weights + KV up to
the current position), the floor at the device-to-device copy bandwidth measured in the same run, and MBU.

Usage: python -m rankserve.bench.decode --out bench/results/decode-b1.json [--batches 1] [--quick]
       python -m rankserve.bench.decode --markdown bench/results/decode-b1.json ... > tables.md (decode.md carries them)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from rankserve.workers.align import GPU_ALIGN, pad_ranks
from rankserve.workers.config import ModelConfig, preset
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import PROJS, Transformer, proj_name

FAMILIES = ("svd-llm", "dobi", "basis-sharing")
# optional rows (--extra-rows): decoder options under evaluation, each timed as "ours-step-<name>" with a greedy check
EXTRA_ROWS = {"fusedattn": dict(attn_merge="fused"), "persist4": dict(persistent=4), "persist8": dict(persistent=8),
              "fusedattn-persist4": dict(attn_merge="fused", persistent=4),
              "stages2": dict(gemv_stages=2), "stages3": dict(gemv_stages=3), "stages4": dict(gemv_stages=4),
              "nosplit": dict(split_k=1), "split2": dict(split_k=2),
              "pdl": dict(pdl="on"), "fused": dict(fuse_norm=True), "pdl-fused": dict(pdl="on", fuse_norm=True),
              # B = 1: the per-kernel step (the default there is the one-launch step, kernels/step_kernel.py)
              "perkernel": dict(one_launch=False), "perkernel-greedy": dict(one_launch=False, greedy=True),
              # B > 1: the whole step in one persistent launch (kernels/step_rows.py; the default there on Hopper
              # since session 27, so these rows force what auto_one_launch already picks)
              "rows": dict(one_launch=True), "rows-greedy": dict(one_launch=True, greedy=True)}
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}  # the CPU run is a smoke test of this script, not a figure


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
SHARED = ("q", "k", "v", "gate", "up")


# --- the cost model --------------------------------------------------------------------------------
def plan_ranks(cfg: ModelConfig, family: str, keep: float, seed: int = 0) -> tuple[dict, dict]:
    """Ranks (and Basis Sharing groups) of a `family`-shaped checkpoint at `keep` (SVD-LLM / Basis Sharing formulas)."""
    shapes = cfg.linear_shapes()
    rng = random.Random(seed)
    ranks, groups = {}, {}
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            out, inp = shapes[p]
            r = int(keep * out * inp / (out + inp))
            if family == "dobi":  # uneven per projection and layer, even numbers, same mean
                r = 2 * round(r * rng.uniform(0.75, 1.25) / 2)
            if family == "basis-sharing" and p in SHARED:
                r = int(inp * out * 2 * keep / (inp + out * 2))  # n = 2 layers share one basis
            ranks[proj_name(i, p)] = max(2, min(r, min(out, inp) - 1))
    if family == "basis-sharing":
        for a in range(0, cfg.num_hidden_layers - 1, 2):
            for p in SHARED:
                groups[f"{p}.{a}-{a + 1}"] = [proj_name(a, p), proj_name(a + 1, p)]
    return ranks, groups


def build_model(cfg: ModelConfig, ranks: dict, groups: dict, device: str, dtype: torch.dtype, seed: int = 0,
                align: int = 1) -> Transformer:
    """Random factors at the given ranks; align > 1 zero-pads ranks as the engine does on CUDA (workers/align.py)."""
    torch.manual_seed(seed)
    m = Transformer(cfg, ranks, groups, device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".U"):
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith(".V") or name.startswith("bases."):
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    if align > 1:
        pad_ranks(m, align)
    return m.eval()


def weight_bytes_read(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every projection (a shared basis once per use), norms, head."""
    total = sum(l.V.numel() + l.U.numel() if l.factorized else l.weight.numel() for l in model.projections().values())
    total += sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    total += model.head_weight().numel()
    return total * model.embed.weight.element_size()


def kv_bytes_read(cfg: ModelConfig, batch: int, ctx: float, elem: int) -> float:
    """K and V of `ctx` cached tokens (mean context during the timed steps) for every row and layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem * ctx * batch


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after warm-up)."""
    n = 1 << 30 if device == "cuda" else 1 << 26  # 1 GiB each way on the GPU
    a = torch.empty(n, dtype=torch.uint8, device=device)
    if device != "cuda":
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            a.copy_(a.flip(0))
            ts.append(time.perf_counter() - t0)
        return 2 * n / statistics.median(ts)
    b = torch.empty_like(a)
    a.random_(0, 255)
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        sync()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(times)


def write_json(path: Path, obj: dict) -> None:
    """Write results atomically: a run killed mid-write leaves the previous file, never half a JSON."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# --- timing ----------------------------------------------------------------------------------------
def time_decode(step, reset, n_tokens: int, repeats: int, warmup: int = 8) -> list[float]:
    """ms/token of `n_tokens` chained steps, `repeats` times; `reset` rewinds the cache to the prompt."""
    reset()
    for _ in range(warmup):
        step()
    out = []
    for _ in range(repeats):
        reset()
        sync()
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            step()
        sync()
        out.append((time.perf_counter() - t0) * 1e3 / n_tokens)
    return out


def row(name: str, ms: list[float], bytes_per_token: float, bw: float, batch: int, **extra) -> dict:
    med = statistics.median(ms)
    floor_ms = bytes_per_token / bw * 1e3
    return dict(row=name, ms_per_token=med, ms_min=min(ms), ms_max=max(ms), repeats=len(ms),
                tok_s=batch * 1e3 / med, bytes_per_token=bytes_per_token, floor_ms=floor_ms,
                mbu=floor_ms / med, **extra)


# --- HF baselines ----------------------------------------------------------------------------------
def hf_model(cfg: ModelConfig, device: str, dtype, ours: Transformer | None):
    """transformers LlamaForCausalLM; with `ours`, each decoder linear becomes nn.Sequential(V, U) holding our factors."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    hcfg = LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")})
    with torch.device(device):
        m = LlamaForCausalLM(hcfg).to(dtype).eval()
    if ours is None:
        return m
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    projs = ours.projections()
    shared_v: dict[int, nn.Linear] = {}
    for i, layer in enumerate(m.model.layers):
        for p, path in names.items():
            src = projs[proj_name(i, p)]
            parent = layer.get_submodule(path.split(".")[0])
            key = id(src.V)
            if key not in shared_v:  # Basis Sharing: members share one V module, as the original code does
                v = nn.Linear(src.in_features, src.rank, bias=False, device=device, dtype=dtype)
                v.weight = src.V
                shared_v[key] = v
            u = nn.Linear(src.rank, src.out_features, bias=False, device=device, dtype=dtype)
            u.weight = src.U
            setattr(parent, path.split(".")[1], nn.Sequential(shared_v[key], u))
        layer.input_layernorm.weight = ours.layers[i].attn_norm.weight
        layer.post_attention_layernorm.weight = ours.layers[i].mlp_norm.weight
    m.model.embed_tokens.weight = ours.embed.weight
    m.model.norm.weight = ours.norm.weight
    m.lm_head.weight = ours.head_weight()
    return m


def time_hf(m, B: int, P: int, n_tokens: int, repeats: int, vocab: int) -> list[float]:
    import warnings

    from transformers import StaticCache

    warnings.filterwarnings("ignore", category=FutureWarning)
    dev = m.device
    cache = StaticCache(config=m.config, max_cache_len=P + n_tokens + 16)
    prompt = torch.randint(0, vocab, (B, P), device=dev)
    with torch.inference_mode():
        out = m(prompt, past_key_values=cache, cache_position=torch.arange(P, device=dev), use_cache=True)
        state = {"pos": P, "tok": out.logits[:, -1:].argmax(-1)}

        def step():
            cp = torch.tensor([state["pos"]], device=dev)  # as HF users write it: a host-built position
            o = m(state["tok"], past_key_values=cache, cache_position=cp, use_cache=True)
            state["tok"] = o.logits[:, -1:].argmax(-1)
            state["pos"] += 1

        def reset():  # rewind the static cache to the prompt (transformers 5.x layers count with cumulative_length)
            state["pos"] = P
            for layer in getattr(cache, "layers", []):
                n = getattr(layer, "cumulative_length", None)
                if isinstance(n, torch.Tensor):
                    n.fill_(P)
                elif n is not None:
                    layer.cumulative_length = P

        return time_decode(step, reset, n_tokens, repeats, warmup=4)


# --- our rows --------------------------------------------------------------------------------------
def time_ours_eager(model: Transformer, B: int, P: int, n_tokens: int, repeats: int) -> list[float]:
    cfg = model.cfg
    cache = KVCache(cfg.num_hidden_layers, B, P + n_tokens + 16, cfg.num_key_value_heads, cfg.head_dim,
                    device=model.embed.weight.device, dtype=model.embed.weight.dtype)
    prompt = torch.randint(0, cfg.vocab_size, (B, P), device=cache.k.device)
    with torch.inference_mode():
        state = {"tok": model(prompt, cache, last_only=True).argmax(-1, keepdim=True)}

        def step():
            state["tok"] = model(state["tok"], cache, last_only=True).argmax(-1, keepdim=True)

        return time_decode(step, lambda: cache.seqlens.fill_(P), n_tokens, repeats)


def make_decoder(model: Transformer, B: int, S: int, backend: str, graph: str, gemv: str = "auto",
                 **kw) -> FastDecoder:
    if model.embed.weight.device.type != "cuda":
        graph = "none"
    return FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=S, backend=backend, graph=graph, gemv=gemv,
                                           **kw))


@contextmanager
def b1_tiles(block_n: int, block_k: int, warps: int):
    """Bench only: every B = 1 decode GEMV (plain, q/k/v, gate/up) uses this tile while a decoder is built,
    captured and timed inside the block, to sweep tiles over the whole step rather than one kernel in isolation."""
    from rankserve.kernels import gate_up, lowrank_linear, qkv_rope
    mods = (lowrank_linear, gate_up, qkv_rope)
    saved = [m.gemv_config for m in mods]

    def config(B: int, N: int, on_gpu: bool, K: int = 0) -> tuple[int, int, int, int]:
        return (block_n, block_k, warps, 1) if B == 1 and on_gpu else saved[0](B, N, on_gpu, K)

    for m in mods:
        m.gemv_config = config
    try:
        yield
    finally:
        for m, f in zip(mods, saved):
            m.gemv_config = f


def mark_static(dec: FastDecoder) -> None:
    """Tell torch.compile that the decoder's buffers and cache live at fixed addresses (as gpt-fast's module
    buffers do), so cudagraph trees accept the step's in-place writes to them instead of skipping cudagraphs."""
    mark = torch._dynamo.mark_static_address
    for t in list(vars(dec).values()) + list(vars(dec.cache).values()):
        if isinstance(t, torch.Tensor):
            mark(t)


def time_fast(dec: FastDecoder, P: int, n_tokens: int, repeats: int, compiled=None) -> list[float]:
    """Greedy decoding: each step takes the argmax of the last logits (inside the step with greedy=True)."""
    cfg, B = dec.cfg, dec.dcfg.batch_size
    prompt = torch.randint(0, cfg.vocab_size, (B, P), device=dec.tokens.device)
    with torch.inference_mode():
        logits = dec.prefill(prompt)
        dec.tokens.copy_(logits.argmax(-1))

        if dec.dcfg.greedy:
            step = dec.step_greedy
        elif compiled is None:
            def step():
                dec.step(dec.logits.argmax(-1))
        else:
            def step():
                dec.tokens.copy_(dec.logits.argmax(-1))
                compiled()

        return time_decode(step, lambda: dec.rewind(P), n_tokens, repeats)


def greedy_match(model: Transformer, dec: FastDecoder, P: int, n: int) -> dict:
    """Greedy tokens of the fast path vs the eager runtime for n steps; the first mismatch if any, and whether
    the mismatches are near-ties: the fast path's largest logit error (max_logit_err, a step's max |fast - eager|
    over the vocabulary) against, at each mismatched step, the eager logits' margin between their token and the
    fast path's (a rounding error of e can flip a margin below 2 e)."""
    cfg, B = model.cfg, dec.dcfg.batch_size
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (B, P), device=dec.tokens.device)
    cache = KVCache(cfg.num_hidden_layers, B, P + n + 1, cfg.num_key_value_heads, cfg.head_dim,
                    device=prompt.device, dtype=model.embed.weight.dtype)
    with torch.inference_mode():
        lg = model(prompt, cache, last_only=True)
        eager, fast, e_lg, f_lg = [], [], [], []
        for _ in range(n):
            e_lg.append(lg.float())
            eager.append(lg.argmax(-1))
            lg = model(eager[-1][:, None], cache, last_only=True)
        lg = dec.prefill(prompt)
        for s in range(n):  # greedy decoders: the token the step itself chose (its in-graph argmax)
            f_lg.append(lg.float().clone())
            fast.append(dec.tokens.clone() if dec.dcfg.greedy and s else lg.argmax(-1))
            lg = dec.step(eager[s]).clone()  # teacher-forced on eager tokens so the logits stay comparable
        e, f = torch.stack(eager, 1), torch.stack(fast, 1)  # (B, n)
        E, F = torch.stack(e_lg, 1), torch.stack(f_lg, 1)  # (B, n, vocab) fp32
        err = (F - E).abs().amax(-1)  # (B, n)
        margin = E.gather(-1, e[..., None])[..., 0] - E.gather(-1, f[..., None])[..., 0]  # (B, n), 0 where equal
    same = (e == f).cpu()
    first = None if bool(same.all()) else int((~same).any(0).nonzero()[0])
    bad = (~same).nonzero().tolist()
    mism = [dict(row=b, step=s, eager_margin=round(float(margin[b, s]), 5), logit_err=round(float(err[b, s]), 5))
            for b, s in bad]
    return dict(steps=n, token_match=float(same.float().mean()), first_mismatch_step=first,
                max_logit_err=round(float(err.max()), 5), median_logit_err=round(float(err.median()), 5),
                logit_std=round(float(E.std(-1).median()), 5), mismatches=mism,
                near_ties=all(m["eager_margin"] <= 2 * m["logit_err"] for m in mism))


# --- cases -----------------------------------------------------------------------------------------
def run_case(res: dict, cfg, family, keep, P, B, args, bw, dense_cache) -> None:
    dev, dt = args.device, DTYPES[args.device]
    ranks, groups = plan_ranks(cfg, family, keep)
    model = build_model(cfg, ranks, groups, dev, dt, align=args.align if dev == "cuda" else 1)
    wbytes = weight_bytes_read(model)
    n, reps = args.tokens, args.repeats
    kv = kv_bytes_read(cfg, B, P + n / 2, 2)
    bpt = wbytes + kv
    from rankserve.workers.checkpoint import count_params
    kept, dense = count_params(cfg, ranks, groups)
    case = dict(family=family, keep=round(kept / dense, 4), keep_target=keep, prompt=P, batch=B, align=args.align,
                weight_bytes=wbytes, kv_bytes=kv, rows=[])
    res["cases"].append(case)

    def add(name, fn, bytes_=bpt, **extra):
        try:
            case["rows"].append(row(name, fn(), bytes_, bw, B, **extra))
            r = case["rows"][-1]
            print(f"  {name:18s} {r['ms_per_token']:8.3f} ms/token  MBU {r['mbu']:.2f}", flush=True)
        except Exception as e:  # one failing row must not stop the run
            case["rows"].append(dict(row=name, error=f"{type(e).__name__}: {e}"))
            traceback.print_exc()
        empty_cache()

    print(f"case {family} keep {keep} prompt {P} B {B}: ranks {min(ranks.values())}..{max(ranks.values())}", flush=True)
    key = (P, B)
    if "hf-dense" not in args.skip:
        if key not in dense_cache:
            hfd = hf_model(cfg, dev, dt, None)
            dbytes = sum(p.numel() for n_, p in hfd.named_parameters() if "embed" not in n_) * 2 + kv
            try:
                dense_cache[key] = row("hf-dense-eager", time_hf(hfd, B, P, args.hf_tokens, reps, cfg.vocab_size),
                                       dbytes, bw, B)
            except Exception as e:
                dense_cache[key] = dict(row="hf-dense-eager", error=str(e))
            del hfd
            gc.collect()
            empty_cache()
        case["rows"].append(dense_cache[key])
    if "hf-lowrank" not in args.skip:
        hfl = hf_model(cfg, dev, dt, model)
        add("hf-lowrank-eager", lambda: time_hf(hfl, B, P, args.hf_tokens, reps, cfg.vocab_size))
        del hfl
        gc.collect()
    if "eager" not in args.skip and B == 1 and P == args.prompts[0]:
        add("ours-eager", lambda: time_ours_eager(model, B, P, args.hf_tokens, reps))
    S = P + n + 16
    if args.compile and (family, keep, P, B) == ("svd-llm", 0.6, args.prompts[0], 1):
        def compiled_row():
            dec = make_decoder(model, B, S, "torch", "none")
            mark_static(dec)
            fn = torch.compile(dec._step_body, mode="reduce-overhead", fullgraph=True)
            t0 = time.perf_counter()
            with torch.inference_mode():
                dec.prefill(torch.randint(0, cfg.vocab_size, (B, P), device=dev))
                for _ in range(3):
                    fn()
            sync()
            case["compile_s"] = time.perf_counter() - t0
            return time_fast(dec, P, n, reps, compiled=fn)
        add("ours-compile", compiled_row)
    first = B == 1 and P == args.prompts[0]
    if first and "torch-graph" not in args.skip:
        add("ours-torch-graph", lambda: time_fast(make_decoder(model, B, S, "torch", "step"), P, n, reps))
    add("ours-graph-step-triton", lambda: time_fast(make_decoder(model, B, S, "triton", "step"), P, n, reps),
        gemv="triton")
    add("ours-step-greedy", lambda: time_fast(make_decoder(model, B, S, "triton", "step", greedy=True), P, n, reps),
        gemv="triton", note="argmax inside the step's graph")
    if B == 1:  # every B = 1 case (long prompts run the attention split merge)
        try:
            case["greedy_check_greedy"] = greedy_match(model, make_decoder(model, B, P + 65, "triton", "step",
                                                                           greedy=True), P, 64)
            print(f"  greedy check (in-graph argmax): {case['greedy_check_greedy']}", flush=True)
        except Exception as e:
            case["greedy_check_greedy"] = dict(error=f"{type(e).__name__}: {e}")
    add("ours-step-nopdl", lambda: time_fast(make_decoder(model, B, S, "triton", "step", pdl="off", one_launch=False),
                                             P, n, reps))
    add("ours-step-unfused", lambda: time_fast(make_decoder(model, B, S, "triton", "step", pdl="off",
                                                            fuse_norm=False), P, n, reps))
    if (first and (family, keep) == (args.families[0], args.keeps[0])) or "variants" not in args.skip:
        add("ours-graph-layer", lambda: time_fast(make_decoder(model, B, S, "triton", "layer"), P, n, reps))
        add("ours-graph-step-cublas", lambda: time_fast(make_decoder(model, B, S, "triton", "step", "cublas"), P, n,
                                                        reps), gemv="cublas")
    for name in args.extra_rows:
        kw = EXTRA_ROWS[name]
        add(f"ours-step-{name}", lambda: time_fast(make_decoder(model, B, S, "triton", "step", **kw), P, n, reps), **kw)
        try:
            case[f"greedy_check_{name}"] = greedy_match(model, make_decoder(model, B, P + 65, "triton", "step", **kw),
                                                        P, 64)
            print(f"  greedy check {name}: {case[f'greedy_check_{name}']}", flush=True)
        except Exception as e:
            case[f"greedy_check_{name}"] = dict(error=f"{type(e).__name__}: {e}")
    for spec in (args.b1_tiles if B == 1 else []):
        bn, bk, w = (int(v) for v in spec.split(","))

        def timed(bn=bn, bk=bk, w=w):
            with b1_tiles(bn, bk, w):
                return time_fast(make_decoder(model, B, S, "triton", "step"), P, n, reps)

        add(f"ours-step-tiles-{bn}x{bk}x{w}", timed, tiles=[bn, bk, w])
    try:  # every batch size: the default step (one launch on Hopper at B = 1..16) gates the case's figures
        case["greedy_check"] = greedy_match(model, make_decoder(model, B, P + 65, "triton", "step"), P, 64)
        print(f"  greedy check: {case['greedy_check']}", flush=True)
    except Exception as e:
        case["greedy_check"] = dict(error=str(e))
    del model
    gc.collect()
    empty_cache()


def run_long(res: dict, cfg, args, bw) -> None:
    """One long B=1 run of args.long decoded tokens (svd-llm keep 0.6, prompt 128), ms/token per 1024-token chunk;
    the HF low-rank baseline sampled at several contexts (prefill to that context, then 32 timed steps)."""
    dev, dt, P = args.device, DTYPES[args.device], 128
    ranks, groups = plan_ranks(cfg, "svd-llm", 0.6)
    model = build_model(cfg, ranks, groups, dev, dt, align=args.align if dev == "cuda" else 1)
    wbytes = weight_bytes_read(model)
    S = P + args.long + 8
    dec = make_decoder(model, 1, S, "triton", "step")
    chunks = []
    with torch.inference_mode():
        dec.prefill(torch.randint(0, cfg.vocab_size, (1, P), device=dev))
        tok = dec.logits.argmax(-1)
        dec.step(tok)  # capture
        done = 1
        t_all = time.perf_counter()
        while done < args.long:
            m = min(1024, args.long - done)
            sync()
            t0 = time.perf_counter()
            for _ in range(m):
                dec.step(dec.logits.argmax(-1))
            sync()
            ms = (time.perf_counter() - t0) * 1e3 / m
            ctx = P + done + m / 2
            chunks.append(dict(context=ctx, ms_per_token=ms,
                               mbu=(wbytes + kv_bytes_read(cfg, 1, ctx, 2)) / bw * 1e3 / ms))
            done += m
        total_s = time.perf_counter() - t_all
    long = dict(tokens=args.long, total_s=total_s, ms_per_token=total_s * 1e3 / (args.long - 1), chunks=chunks,
                baseline=[])
    res["long"] = long
    print(f"long run: {args.long} tokens, {long['ms_per_token']:.3f} ms/token", flush=True)
    del dec
    empty_cache()
    hfl = hf_model(cfg, dev, dt, model)
    for ctx in args.long_baseline_contexts:
        try:
            ms = time_hf(hfl, 1, ctx, 32, 3, cfg.vocab_size)
            ours = min(chunks, key=lambda c: abs(c["context"] - ctx))
            long["baseline"].append(dict(context=ctx, hf_lowrank_ms=statistics.median(ms), ours_ms=ours["ms_per_token"],
                                         speedup=statistics.median(ms) / ours["ms_per_token"]))
            print(f"  hf-lowrank at context {ctx}: {statistics.median(ms):.3f} ms/token", flush=True)
        except Exception as e:
            long["baseline"].append(dict(context=ctx, error=str(e)))
        empty_cache()
    del hfl, model
    gc.collect()
    empty_cache()


def hf_static_prefill(m, x: torch.Tensor):
    """A closure running HF's prefill of x into one StaticCache (allocated here, once), as a server would fill it."""
    from transformers import StaticCache

    S = x.shape[1]
    cache = StaticCache(config=m.config, max_cache_len=S)
    pos = torch.arange(S, device=x.device)

    def run():
        for layer in getattr(cache, "layers", []):  # transformers 5.x layers count with cumulative_length
            n = getattr(layer, "cumulative_length", None)
            if isinstance(n, torch.Tensor):
                n.zero_()
            elif n is not None:
                layer.cumulative_length = 0
        return m(x, past_key_values=cache, cache_position=pos, use_cache=True, logits_to_keep=1)

    return run


def run_prefill(res: dict, cfg, args) -> None:
    """Prefill latency (B=1) of the HF low-rank baseline and our runtime at each length; and one layer's attention
    built from the factors: rebuild Q/K/V + SDPA (flash) vs the factorized Triton prefill kernel.
    Both fill a KV cache allocated once outside the timing (ours: KVCache; HF: StaticCache); `hf_lowrank_nocache`
    is HF without any cache (use_cache=False: no K/V stored), the protocol of the earlier runs."""
    dev, dt = args.device, DTYPES[args.device]
    ranks, groups = plan_ranks(cfg, "svd-llm", 0.6)
    model = build_model(cfg, ranks, groups, dev, dt, align=args.align if dev == "cuda" else 1)
    hfl = hf_model(cfg, dev, dt, model)
    out = []
    for S in args.prefill:
        entry = dict(tokens=S)
        x = torch.randint(0, cfg.vocab_size, (1, S), device=dev)
        with torch.inference_mode():
            cache = KVCache(cfg.num_hidden_layers, 1, S, cfg.num_key_value_heads, cfg.head_dim, device=dev, dtype=dt)

            def ours():
                cache.reset()
                return model(x, cache, last_only=True)

            for name, fn in (("ours", ours), ("hf_lowrank", hf_static_prefill(hfl, x)),
                             ("hf_lowrank_nocache", lambda: hfl(x, use_cache=False, logits_to_keep=1))):
                try:
                    fn()
                    sync()
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        fn()
                        sync()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    entry[f"{name}_ms"] = statistics.median(ts)
                except Exception as e:
                    entry[f"{name}_error"] = str(e)
                empty_cache()
            del cache
            if dev == "cuda":
                entry.update(prefill_attention_compare(model, S))
        out.append(entry)
        print(f"prefill {S}: {entry}", flush=True)
    res["prefill"] = out
    del hfl, model
    gc.collect()
    empty_cache()


def prefill_attention_compare(model: Transformer, S: int) -> dict:
    from triton.testing import do_bench

    from rankserve.kernels.prefill_attention import prefill_attention

    cfg = model.cfg
    a = model.layers[0].attn
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.randn(1, S, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    Pq, Pk, Pv = x @ a.q.V.t(), x @ a.k.V.t(), x @ a.v.V.t()  # (1, S, r)
    half = D // 2
    cos, sin = model.rope_cos[:S, :half].contiguous(), model.rope_sin[:S, :half].contiguous()
    seqlens = torch.tensor([S], device="cuda", dtype=torch.int32)
    Uq, Uk, Uv = a.q.U.view(H, D, -1), a.k.U.view(Hkv, D, -1), a.v.U.view(Hkv, D, -1)

    def rebuild_sdpa():
        q = (Pq @ a.q.U.t()).view(1, S, H, D)
        k = (Pk @ a.k.U.t()).view(1, S, Hkv, D)
        v = (Pv @ a.v.U.t()).view(1, S, Hkv, D)
        c, s_ = model.rope_cos[:S][None], model.rope_sin[:S][None]
        from rankserve.workers.model import apply_rope
        q, k = apply_rope(q, c, s_), apply_rope(k, c, s_)
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                is_causal=True, enable_gqa=H != Hkv)

    out = {}
    try:
        out["attn_rebuild_sdpa_ms"] = do_bench(rebuild_sdpa, return_mode="median")
    except Exception as e:
        out["attn_rebuild_sdpa_error"] = str(e)
    try:
        ref = rebuild_sdpa().transpose(1, 2).float()
        got = prefill_attention(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)
        got = got[0] if isinstance(got, tuple) else got
        out["attn_factorized_rel_err"] = float((got.float() - ref).norm() / ref.norm())
        out["attn_factorized_ms"] = do_bench(lambda: prefill_attention(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens),
                                             return_mode="median")
    except Exception as e:
        out["attn_factorized_error"] = f"{type(e).__name__}: {e}"
    return out


# --- markdown --------------------------------------------------------------------------------------
def greedy_summary(g: dict) -> str:
    """One line of a greedy_match result (the JSON keeps every mismatch): the share of tokens that agree, the
    first mismatch, and whether each mismatch is a near-tie (eager margin <= 2x the fast path's logit error)."""
    if "error" in g:
        return f"failed: {g['error'][:120]}"
    mism = g["mismatches"]
    line = f"{g['token_match'] * 100:.1f} % of {g['steps']} steps x rows agree"
    if not mism:
        return line + f"; max logit error {g['max_logit_err']:.3g}"
    worst = max(m["eager_margin"] for m in mism)
    ties = "every one a near-tie" if g["near_ties"] else "NOT all near-ties"
    return (line + f"; {len(mism)} mismatches, the first at step {g['first_mismatch_step']}, {ties} (largest eager "
            f"margin {worst:.3g}; logit error median {g['median_logit_err']:.3g}, max {g['max_logit_err']:.3g})")


def markdown(paths: list[str]) -> str:
    docs = [json.loads(Path(p).read_text()) for p in paths]
    env = docs[0]["env"]
    lines = [f"# Decode benchmark — {env['gpu']}", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}, CUDA {env['cuda']}. "
             "Measured device-to-device copy bandwidth (bytes read + written), each file's own run: "
             + ", ".join(f"**{d['env']['copy_bw'] / 1e12:.2f} TB/s** (`{Path(p).name}`)" for d, p in zip(docs, paths))
             + ". "
             "Random weights at the LLaMA-7B shape, bf16 (speed does not depend on the values). "
             "ms/token = median of the repeats (min–max); MBU = (weight + KV bytes read per token) / copy bandwidth / time.",
             ""]
    for d, path in zip(docs, paths):
        for c in d.get("cases", []):
            lines.append(f"## {c['family']} keep {c['keep']} (target {c['keep_target']}), prompt {c['prompt']}, "
                         f"B={c['batch']} (`{Path(path).name}`)")
            lines.append("")
            lines.append("| path | ms/token (min–max) | tok/s | MB read/token | floor ms | MBU | vs hf-lowrank |")
            lines.append("| --- | --- | --- | --- | --- | --- | --- |")
            base = next((r["ms_per_token"] for r in c["rows"] if r.get("row") == "hf-lowrank-eager" and "ms_per_token" in r), None)
            for r in c["rows"]:
                if "error" in r:
                    lines.append(f"| {r['row']} | failed: {r['error'][:80]} | | | | | |")
                    continue
                sp = f"{base / r['ms_per_token']:.2f}×" if base else ""
                lines.append(f"| {r['row']} | {r['ms_per_token']:.3f} ({r['ms_min']:.3f}–{r['ms_max']:.3f}) | "
                             f"{r['tok_s']:.0f} | {r['bytes_per_token'] / 1e6:.0f} | {r['floor_ms']:.3f} | "
                             f"{r['mbu'] * 100:.0f}% | {sp} |")
            if "greedy_check" in c:
                lines.append("\nGreedy check (the default step vs the eager runtime, teacher-forced): "
                             + greedy_summary(c["greedy_check"]))
            for k_, v_ in c.items():
                if k_.startswith("greedy_check_"):
                    lines.append(f"\nGreedy check of ours-step-{k_[len('greedy_check_'):]}: {greedy_summary(v_)}")
            if "compile_s" in c:
                lines.append(f"\ntorch.compile warm-up: {c['compile_s']:.0f} s")
            lines.append("")
        if "long" in d:
            lg = d["long"]
            lines += [f"## Long run: {lg['tokens']} decoded tokens, B=1, svd-llm keep 0.6, triton-step",
                      "", f"Mean {lg['ms_per_token']:.3f} ms/token over the whole run ({lg['total_s']:.1f} s).", "",
                      "| context | ms/token | MBU |", "| --- | --- | --- |"]
            for ch in lg["chunks"][:: max(1, len(lg["chunks"]) // 8)]:
                lines.append(f"| {ch['context']:.0f} | {ch['ms_per_token']:.3f} | {ch['mbu'] * 100:.0f}% |")
            lines += ["", "| context | hf-lowrank ms/token | ours ms/token | speed-up |", "| --- | --- | --- | --- |"]
            for b in lg["baseline"]:
                if "error" in b:
                    lines.append(f"| {b['context']} | failed: {b['error'][:60]} | | |")
                else:
                    lines.append(f"| {b['context']} | {b['hf_lowrank_ms']:.3f} | {b['ours_ms']:.3f} | {b['speedup']:.2f}× |")
            lines.append("")
        if "prefill" in d:
            lines += ["## Prefill latency, B=1, svd-llm keep 0.6", "",
                      "| tokens | ours ms | hf-lowrank ms | one layer's attention: rebuild+SDPA ms | "
                      "factorized Triton ms (rel. err) |",
                      "| --- | --- | --- | --- | --- |"]
            for e in d["prefill"]:
                fa = (f"{e['attn_factorized_ms']:.3f} ({e['attn_factorized_rel_err']:.1e})" if "attn_factorized_ms" in e
                      else e.get("attn_factorized_error", "")[:60])
                # runs before hf_lowrank_nocache_ms existed timed HF without a cache (and ours allocating one)
                hf = (f"{e.get('hf_lowrank_ms', float('nan')):.1f} StaticCache, {e['hf_lowrank_nocache_ms']:.1f} no cache"
                      if "hf_lowrank_nocache_ms" in e else f"{e.get('hf_lowrank_ms', float('nan')):.1f} no cache")
                lines.append(f"| {e['tokens']} | {e.get('ours_ms', float('nan')):.1f} | {hf} | "
                             f"{e.get('attn_rebuild_sdpa_ms', float('nan')):.3f} | {fa} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "rankserve bench decode") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/decode.json")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--keeps", nargs="+", type=float, default=[0.6, 0.8])
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per timed repeat")
    ap.add_argument("--hf-tokens", type=int, default=32, help="decode steps per timed repeat of the slow eager rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long", type=int, default=0, help="tokens of the long B=1 run (0 = skip)")
    ap.add_argument("--long-baseline-contexts", nargs="+", type=int, default=[128, 4096, 8192, 16384])
    ap.add_argument("--prefill", nargs="*", type=int, default=[], help="prefill lengths to time (e.g. 2048 8192)")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile row for svd-llm 0.6, B=1")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="rows to skip: hf-dense hf-lowrank eager torch-graph; 'variants' = the per-layer-graph and "
                         "cuBLAS rows except in the first case")
    ap.add_argument("--align", type=int, default=GPU_ALIGN,
                    help="zero-pad ranks to a multiple of this on CUDA, as the engine does (1 = stored ranks)")
    ap.add_argument("--b1-tiles", nargs="*", default=[], metavar="BLOCK_N,BLOCK_K,WARPS",
                    help="B = 1 cases: also time the whole step with every GEMV on this tile (rows ours-step-tiles-*)")
    ap.add_argument("--extra-rows", nargs="*", default=[], choices=sorted(EXTRA_ROWS),
                    help="also time these decoder options (rows ours-step-<name>)")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="explicit cases family:keep:prompt:batch (replaces the default plan of cases)")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting new cases after this many seconds")
    ap.add_argument("--markdown", nargs="*", help="render these result JSONs as markdown and exit")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="llama-7b", help="model shape (workers.config.PRESETS)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: bench decode needs a CUDA GPU (--device cpu runs a smoke test of the script)", file=sys.stderr)
        return 2
    import transformers
    import triton

    t_start = time.perf_counter()
    bw = copy_bandwidth(args.device)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    res = dict(env=dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                        transformers=transformers.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                        copy_bw=bw, weights="random, bf16", date=time.strftime("%Y-%m-%d")),
               cases=[], argv=sys.argv[1:] if argv is None else argv)
    print(f"{res['env']['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(out, res)

    cfg = preset(args.preset, max_position_embeddings=max(20480, 128 + args.long + 64))
    if args.prefill_only:
        run_prefill(res, cfg, args)
        save()
        return 0
    dense_cache: dict = {}
    # priority order: B=1 short prompt (all families), the long run, larger batches, long prompts, prefill
    small, big = args.prompts[0], args.prompts[-1]
    plan = [("case", f, k, small, 1) for f in args.families for k in args.keeps]
    plan += [("long",)] if args.long else []
    plan += [("prefill",)] if args.prefill else []
    plan += [("case", f, args.keeps[0], small, B) for B in args.batches if B > 1 for f in args.families]
    plan += [("case", f, k, big, 1) for f in args.families for k in args.keeps] if big != small else []
    plan += [("case", args.families[0], args.keeps[0], big, B) for B in args.batches if B > 1] if big != small else []
    plan += [("case", f, k, P, B) for B in args.batches if B > 1 for P in args.prompts for f in args.families
             for k in args.keeps[1:]]
    if args.cases is not None:  # explicit cases, then the long run and prefill if asked
        plan = [("prefill",)] if args.prefill else []
        plan += [("case", f, float(k), int(P), int(B)) for f, k, P, B in (c.split(":") for c in args.cases)]
        plan += [("long",)] if args.long else []
    for item in plan:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"time budget reached: skipping {item}", flush=True)
            res.setdefault("skipped", []).append(list(item))
            continue
        try:
            if item[0] == "case":
                run_case(res, cfg, *item[1:], args, bw, dense_cache)
            elif item[0] == "long":
                run_long(res, cfg, args, bw)
            else:
                run_prefill(res, cfg, args)
        except Exception as e:  # keep going: the rest of the plan still measures
            traceback.print_exc()
            res.setdefault("failed", []).append(dict(item=list(item), error=f"{type(e).__name__}: {e}"))
        save()
    res["wall_s"] = time.perf_counter() - t_start
    save()
    print(f"wrote {out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
