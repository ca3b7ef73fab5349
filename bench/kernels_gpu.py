"""Correctness + speed of the decode-path Triton kernels at LLaMA-7B shapes, bf16, on one GPU.

    python bench/kernels_gpu.py --out bench/results/kernels_h200.json            # all kernels + a 32-layer step
    python bench/kernels_gpu.py --out /tmp/sweep.json --only gemv_sweep,decode_sweep,prefill_sweep   # tile sweeps

Each case checks the kernel against an fp64 torch reference (pass: error <= 4 x plain bf16 torch's error +
bf16 eps, as in tests/), then times it with triton.testing.do_bench (median; do_bench flushes L2 between runs,
so weights come from HBM; the case is replayed as a CUDA graph, so no Python launch overhead) and prints
achieved GB/s = bytes that must move / time, against a measured
device-to-device copy bandwidth (bytes read + written). A failing case prints its traceback and the others
still run. Importable without a GPU: nothing touches CUDA before main().
"""

import argparse
import json
import time
import traceback

import torch

DT = torch.bfloat16
KEEP = 0.6  # fraction of decoder-linear parameters kept; rank of (out, in) = KEEP * out * in / (out + in)
HIDDEN, INTER, H, D = 4096, 11008, 32, 128  # LLaMA-2-7B


def rank(d_out: int, d_in: int, keep: float = KEEP) -> int:
    return int(keep * d_out * d_in / (d_out + d_in))


def _randn(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _rel_err(out, ref64):
    return ((out.double() - ref64).abs().max() / ref64.abs().max()).item()


def _check(out, ref64, base, what):
    """Same criterion as tests/kernel_utils.assert_close; returns the errors for the JSON."""
    err, err_torch = _rel_err(out, ref64), _rel_err(base, ref64)
    ok = bool(torch.isfinite(out).all()) and err <= 4 * err_torch + torch.finfo(out.dtype).eps
    if not ok:
        print(f"  !! {what}: kernel err {err:.3g} vs torch bf16 err {err_torch:.3g}")
    return {"ok": ok, "err": err, "err_torch_bf16": err_torch}


def graph_ms(fn, rep=50, graph=True):
    """Median ms of fn over cold-L2 runs. graph=True replays fn captured as a CUDA graph, so Python launch
    overhead (tens of us for a Triton launch) stays out of the number, as it does in the decode step."""
    from triton.testing import do_bench
    if not graph:
        return do_bench(fn, warmup=10, rep=rep, return_mode="median")
    fn()  # compile / autotune outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
    except RuntimeError:  # not capturable: say so and time it eagerly
        traceback.print_exc()
        print("  (capture failed: eager timing, includes launch overhead)")
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=rep, return_mode="median")
    return do_bench(g.replay, warmup=10, rep=rep, return_mode="median")


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 29, device="cuda", dtype=DT)  # 1 GiB
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), graph=False)
    return 2 * _nbytes(src) / ms / 1e6


def case_lowrank_linear(B, d_in, d_out):
    from rankserve.kernels.lowrank_linear import lowrank_linear, lowrank_linear_ref
    r = rank(d_out, d_in)
    x, V, U = _randn(B, d_in), _randn(r, d_in, scale=d_in ** -0.5), _randn(d_out, r, scale=r ** -0.5)
    t, y = torch.empty(B, r, device="cuda"), torch.empty(B, d_out, device="cuda", dtype=DT)
    lowrank_linear(x, V, U, out=y, t=t)
    res = _check(y, lowrank_linear_ref(x.double(), V.double(), U.double()), lowrank_linear_ref(x, V, U), "lowrank")
    res["ms"] = graph_ms(lambda: lowrank_linear(x, V, U, out=y, t=t))
    res["torch_ms"] = graph_ms(lambda: lowrank_linear_ref(x, V, U))
    W = _randn(d_out, d_in)
    res["torch_dense_ms"] = graph_ms(lambda: x @ W.T)
    res["bytes"] = _nbytes(x, V, U, y)
    res["shape"] = dict(B=B, d_in=d_in, r=r, d_out=d_out)
    return res


def case_qkv_rope(B, S_max, H_kv):
    from rankserve.kernels.qkv_rope import qkv_rope, qkv_rope_ref
    rq, rk = rank(H * D, HIDDEN), rank(H_kv * D, HIDDEN)
    rv = rk
    x = _randn(B, HIDDEN)
    Vqkv = _randn(rq + rk + rv, HIDDEN, scale=HIDDEN ** -0.5)
    Uq, Uk, Uv = _randn(H * D, rq, scale=rq ** -0.5), _randn(H_kv * D, rk, scale=rk ** -0.5), _randn(H_kv * D, rv, scale=rv ** -0.5)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    ang = torch.arange(S_max, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    cos, sin = ang.cos().float(), ang.sin().float()
    k_cache, v_cache = _randn(B, S_max, H_kv, D), _randn(B, S_max, H_kv, D)
    cache_seqlens = torch.randint(0, S_max, (B,), device="cuda", dtype=torch.int32)
    q, t = torch.empty(B, H, D, device="cuda", dtype=DT), torch.empty(B, rq + rk + rv, device="cuda")
    kr, vr = k_cache.double(), v_cache.double()
    q64 = qkv_rope_ref(x.double(), Vqkv.double(), Uq.double(), Uk.double(), Uv.double(), cos.double(), sin.double(),
                       kr, vr, cache_seqlens)
    kb, vb = k_cache.clone(), v_cache.clone()
    qb = qkv_rope_ref(x, Vqkv, Uq, Uk, Uv, cos, sin, kb, vb, cache_seqlens)
    qkv_rope(x, Vqkv, Uq, Uk, Uv, cos, sin, k_cache, v_cache, cache_seqlens, q_out=q, t=t)
    rows, pos = torch.arange(B, device="cuda"), cache_seqlens.long()
    res = _check(q, q64, qb, "qkv_rope q")
    res_k = _check(k_cache[rows, pos], kr[rows, pos], kb[rows, pos], "qkv_rope k")
    res["ok"] = res["ok"] and res_k["ok"]
    res["ms"] = graph_ms(lambda: qkv_rope(x, Vqkv, Uq, Uk, Uv, cos, sin, k_cache, v_cache, cache_seqlens, q_out=q, t=t))
    res["torch_ms"] = graph_ms(lambda: qkv_rope_ref(x, Vqkv, Uq, Uk, Uv, cos, sin, kb, vb, cache_seqlens))
    res["bytes"] = _nbytes(x, Vqkv, Uq, Uk, Uv, q) + 2 * B * H_kv * D * 2
    res["shape"] = dict(B=B, hidden=HIDDEN, H=H, H_kv=H_kv, D=D, rq=rq, rk=rk, rv=rv)
    return res


def case_gate_up(B):
    from rankserve.kernels.gate_up import gate_up, gate_up_ref
    r = rank(INTER, HIDDEN)
    x = _randn(B, HIDDEN)
    Vgu = _randn(2 * r, HIDDEN, scale=HIDDEN ** -0.5)
    Ug, Uu = _randn(INTER, r, scale=2 * r ** -0.5), _randn(INTER, r, scale=r ** -0.5)
    h, t = torch.empty(B, INTER, device="cuda", dtype=DT), torch.empty(B, 2 * r, device="cuda")
    gate_up(x, Vgu, Ug, Uu, out=h, t=t)
    res = _check(h, gate_up_ref(x.double(), Vgu.double(), Ug.double(), Uu.double()), gate_up_ref(x, Vgu, Ug, Uu), "gate_up")
    res["ms"] = graph_ms(lambda: gate_up(x, Vgu, Ug, Uu, out=h, t=t))
    res["torch_ms"] = graph_ms(lambda: gate_up_ref(x, Vgu, Ug, Uu))
    res["bytes"] = _nbytes(x, Vgu, Ug, Uu, h)
    res["shape"] = dict(B=B, hidden=HIDDEN, rg=r, ru=r, inter=INTER)
    return res


def case_rmsnorm(B):
    from rankserve.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    x, w, res_ = _randn(B, HIDDEN), _randn(HIDDEN) + 1, _randn(B, HIDDEN)
    out = torch.empty_like(x)
    r64, rb = res_.double(), res_.clone()
    ref64, base = rmsnorm_ref(x.double(), w.double(), 1e-5, residual=r64), rmsnorm_ref(x, w, 1e-5, residual=rb)
    rmsnorm(x, w, 1e-5, residual=res_, out=out)
    res = _check(out, ref64, base, "rmsnorm")
    res["ms"] = graph_ms(lambda: rmsnorm(x, w, 1e-5, residual=res_, out=out))
    res["torch_ms"] = graph_ms(lambda: rmsnorm_ref(x, w, 1e-5, residual=rb))
    res["bytes"] = _nbytes(x, w, res_, res_, out)
    res["shape"] = dict(B=B, hidden=HIDDEN)
    return res


def case_decode_attention(B, L, H_kv):
    from rankserve.kernels.decode_attention import decode_attention, decode_attention_ref, default_num_splits, flash_attn_decode
    S_max = L
    q, k_cache, v_cache = _randn(B, H, D), _randn(B, S_max, H_kv, D), _randn(B, S_max, H_kv, D)
    cache_seqlens = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)  # L keys
    ns = default_num_splits(S_max, B, H_kv)
    out = torch.empty_like(q)
    mid_o, mid_lse = torch.empty(B, H, ns, D, device="cuda"), torch.empty(B, H, ns, device="cuda")
    decode_attention(q, k_cache, v_cache, cache_seqlens, num_splits=ns, out=out, mid_o=mid_o, mid_lse=mid_lse)
    res = _check(out, decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens),
                 decode_attention_ref(q, k_cache, v_cache, cache_seqlens), "decode_attention")
    res["ms"] = graph_ms(lambda: decode_attention(q, k_cache, v_cache, cache_seqlens, num_splits=ns, out=out,
                                             mid_o=mid_o, mid_lse=mid_lse))
    kt, vt = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (B, H_kv, S, D) views
    sdpa = torch.nn.functional.scaled_dot_product_attention
    res["torch_sdpa_ms"] = graph_ms(lambda: sdpa(q[:, :, None], kt, vt, enable_gqa=H != H_kv))
    try:
        import flash_attn  # noqa: F401
        res["flash_attn_ms"] = graph_ms(lambda: flash_attn_decode(q, k_cache, v_cache, cache_seqlens, num_splits=ns))
    except ImportError:
        pass
    res["bytes"] = _nbytes(q, out) + 2 * B * L * H_kv * D * 2
    res["shape"] = dict(B=B, L=L, H=H, H_kv=H_kv, D=D, num_splits=ns)
    return res


def case_prefill_attention(B, S, H_kv):
    from rankserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from rankserve.kernels.qkv_rope import rope_ref
    rq, rk = rank(H * D, HIDDEN), rank(H_kv * D, HIDDEN)
    Pq, Pk, Pv = _randn(B, S, rq), _randn(B, S, rk), _randn(B, S, rk)
    Uq, Uk, Uv = _randn(H, D, rq, scale=rq ** -0.5), _randn(H_kv, D, rk, scale=rk ** -0.5), _randn(H_kv, D, rk, scale=rk ** -0.5)
    ang = torch.arange(S, device="cuda", dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, D, 2, device="cuda") / D)
    cos, sin = ang.cos().float(), ang.sin().float()
    seqlens = torch.full((B,), S, device="cuda", dtype=torch.int32)
    out = torch.empty(B, S, H, D, device="cuda", dtype=DT)
    k_cache, v_cache = torch.empty(B, S, H_kv, D, device="cuda", dtype=DT), torch.empty(B, S, H_kv, D, device="cuda", dtype=DT)
    run = lambda: prefill_attention(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, k_cache=k_cache, v_cache=v_cache, out=out)
    run()
    o64, k64, _ = prefill_attention_ref(*(t.double() for t in (Pq, Pk, Pv, Uq, Uk, Uv, cos, sin)), seqlens)
    ob, kb, _ = prefill_attention_ref(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)
    res = _check(out, o64, ob, "prefill out")
    res_k = _check(k_cache, k64, kb, "prefill k")
    res["ok"] = res["ok"] and res_k["ok"]
    res["ms"] = graph_ms(run)

    def torch_path():  # materialize q/k/v, RoPE, flash SDPA
        q = rope_ref(torch.einsum("bsr,hdr->bhsd", Pq, Uq), cos.to(DT), sin.to(DT))
        k = rope_ref(torch.einsum("bsr,hdr->bhsd", Pk, Uk), cos.to(DT), sin.to(DT))
        v = torch.einsum("bsr,hdr->bhsd", Pv, Uv)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != H_kv)
    res["torch_ms"] = graph_ms(torch_path)
    flops = 4 * B * H * D * S * S / 2 + 2 * B * S * H * D * rq
    flops += B * H * (S / 64) * (S / 2) * 2 * D * (rk + rk)  # K/V rebuilt per (query block, head), causal half
    res["tflops"] = flops / res["ms"] / 1e9
    res["bytes"] = _nbytes(Pq, Pk, Pv, Uq, Uk, Uv, out, k_cache, v_cache)
    res["shape"] = dict(B=B, S=S, H=H, H_kv=H_kv, D=D, rq=rq, rk=rk, rv=rk)
    return res


def case_decode_step(B, L, n_layers=32):
    """n_layers decode layers of the 60%-keep LLaMA-2-7B, composed from the kernels, captured as one CUDA graph."""
    from rankserve.kernels.decode_attention import decode_attention, default_num_splits
    from rankserve.kernels.gate_up import gate_up
    from rankserve.kernels.lowrank_linear import lowrank_linear
    from rankserve.kernels.qkv_rope import qkv_rope
    from rankserve.kernels.rmsnorm import rmsnorm
    r_attn, r_mlp = rank(HIDDEN, HIDDEN), rank(INTER, HIDDEN)
    S_max = L
    ns = default_num_splits(S_max, B, H)
    ang = torch.arange(S_max, device="cuda", dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, D, 2, device="cuda") / D)
    cos, sin = ang.cos().float(), ang.sin().float()
    layers = []
    for _ in range(n_layers):
        layers.append(dict(
            w1=_randn(HIDDEN) + 1, w2=_randn(HIDDEN) + 1,
            Vqkv=_randn(3 * r_attn, HIDDEN, scale=HIDDEN ** -0.5),
            Uq=_randn(HIDDEN, r_attn, scale=r_attn ** -0.5), Uk=_randn(HIDDEN, r_attn, scale=r_attn ** -0.5),
            Uv=_randn(HIDDEN, r_attn, scale=r_attn ** -0.5),
            Vo=_randn(r_attn, HIDDEN, scale=HIDDEN ** -0.5), Uo=_randn(HIDDEN, r_attn, scale=r_attn ** -0.5),
            Vgu=_randn(2 * r_mlp, HIDDEN, scale=HIDDEN ** -0.5),
            Ug=_randn(INTER, r_mlp, scale=r_mlp ** -0.5), Uu=_randn(INTER, r_mlp, scale=r_mlp ** -0.5),
            Vd=_randn(r_mlp, INTER, scale=INTER ** -0.5), Ud=_randn(HIDDEN, r_mlp, scale=r_mlp ** -0.5),
            k_cache=_randn(B, S_max, H, D), v_cache=_randn(B, S_max, H, D)))
    cache_seqlens = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    h = _randn(B, HIDDEN)  # static buffers
    res_ = torch.zeros(B, HIDDEN, device="cuda", dtype=DT)
    xn, attn, hi = torch.empty_like(h), torch.empty(B, H, D, device="cuda", dtype=DT), torch.empty(B, INTER, device="cuda", dtype=DT)
    q = torch.empty(B, H, D, device="cuda", dtype=DT)
    t_qkv, t_a = torch.empty(B, 3 * r_attn, device="cuda"), torch.empty(B, r_attn, device="cuda")
    t_gu, t_m = torch.empty(B, 2 * r_mlp, device="cuda"), torch.empty(B, r_mlp, device="cuda")
    mid_o, mid_lse = torch.empty(B, H, ns, D, device="cuda"), torch.empty(B, H, ns, device="cuda")

    def step():
        for ly in layers:
            rmsnorm(h, ly["w1"], 1e-5, residual=res_, out=xn)
            qkv_rope(xn, ly["Vqkv"], ly["Uq"], ly["Uk"], ly["Uv"], cos, sin, ly["k_cache"], ly["v_cache"],
                     cache_seqlens, q_out=q, t=t_qkv)
            decode_attention(q, ly["k_cache"], ly["v_cache"], cache_seqlens, num_splits=ns, out=attn,
                             mid_o=mid_o, mid_lse=mid_lse)
            lowrank_linear(attn.view(B, HIDDEN), ly["Vo"], ly["Uo"], out=h, t=t_a)
            rmsnorm(h, ly["w2"], 1e-5, residual=res_, out=xn)
            gate_up(xn, ly["Vgu"], ly["Ug"], ly["Uu"], out=hi, t=t_gu)
            lowrank_linear(hi, ly["Vd"], ly["Ud"], out=h, t=t_m)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile outside the graph
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(h).all())
    ms = graph_ms(g.replay, rep=200, graph=False)
    eager_ms = graph_ms(step, rep=200, graph=False)
    weights = sum(_nbytes(*(v for k, v in ly.items() if "cache" not in k)) for ly in layers)
    kv = n_layers * 2 * B * L * H * D * 2
    return {"ok": ok, "ms": ms, "eager_ms": eager_ms, "bytes": weights + kv, "weight_bytes": weights, "kv_bytes": kv,
            "tok_per_s": 1e3 / ms, "shape": dict(B=B, L=L, n_layers=n_layers, r_attn=r_attn, r_mlp=r_mlp, num_splits=ns)}


def _gemv_launch(x, w, y, BLOCK_N, BLOCK_K, num_warps, num_stages, keep=None, klive=None):
    """One raw _gemv_kernel launch with an explicit tile config (what gemv() would pick is in gemv_config)."""
    import triton
    from rankserve.kernels.lowrank_linear import _gemv_kernel, pad_rows
    B, K = x.shape
    N = w.shape[0]
    kp = keep if keep is not None else y
    _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](
        x, w, y, kp, klive if klive is not None else kp, B, N, K, x.stride(0), w.stride(0), y.stride(0),
        kp.stride(0), 0.0, B_PAD=pad_rows(B), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NORM=False, RESIDUAL=False,
        KEEP=keep is not None, LIVE=klive is not None, PDL=False, STAGES=num_stages if B == 1 else 1,
        num_warps=num_warps, num_stages=num_stages)


def gemv_sweep():
    """Times _gemv_kernel tile configs at the V and U stage shapes; the winners go into gemv_config.

    Also the PARSE slot shapes at B = 8 (union 1.05 K in a 2 K slot, 16-padded as the engine pads): the V stage
    with half of its rows beyond the union (keep mask) and the U stage reading a live prefix of longer rows."""
    rows = []
    r_qkv, r_gu = 1232, 1792  # svd-llm keep 0.6 ranks of q/k/v/o and gate/up/down, padded to 16
    shapes = [  # (label, B, N, K, live or None, V stage with dead half?)
        ("v-static", 8, 3 * r_qkv, HIDDEN, None, False), ("u-static", 8, INTER, r_gu, None, False),
        ("v-slot", 8, 6 * r_qkv, HIDDEN, None, True), ("u-slot", 8, INTER, 2 * r_gu, 1888, False),
        ("v-static", 1, 3 * r_qkv, HIDDEN, None, False), ("u-static", 1, INTER, r_gu, None, False)]
    for label, B, N, K, live, dead in shapes:
        x = _randn(B, K) if K == HIDDEN else torch.randn(B, K, device="cuda")
        w = _randn(N, K)
        y = torch.empty(B, N, device="cuda")
        keep = None
        if dead:  # q, k, v segments of 2 r each, the first r live (all rows keep them)
            keep = torch.zeros(B, N, device="cuda", dtype=DT)
            for s0 in range(0, N, 2 * r_qkv):
                keep[:, s0:s0 + r_qkv] = 1
        klive = torch.tensor([live], dtype=torch.int32, device="cuda") if live else None
        if B == 1:
            configs = [(bn, bk, 4, ns) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for ns in (1, 2, 3, 4)]
        else:
            configs = [(bn, bk, 4, ns) for bn in (16, 32) for bk in (64, 128, 256, 512) for ns in (3, 4)]
        best = None
        for cfg in configs:
            try:
                ms = graph_ms(lambda: _gemv_launch(x, w, y, *cfg, keep=keep, klive=klive), rep=20)
            except Exception:  # a config that does not compile is skipped, loudly
                traceback.print_exc()
                continue
            rows.append(dict(label=label, B=B, N=N, K=K, live=live, BLOCK_N=cfg[0], BLOCK_K=cfg[1],
                             num_warps=cfg[2], num_stages=cfg[3], ms=ms))
            if best is None or ms < best["ms"]:
                best = rows[-1]
        print(f"  gemv {label} B={B} N={N} K={K} live={live}: best {best}", flush=True)
    return rows


def decode_sweep():
    """Times stage-1 tile configs of decode_attention; the winner goes into decode_attention._decode_config."""
    from rankserve.kernels.decode_attention import _launch_decode, default_num_splits
    rows = []
    for B, L, H_kv in ((1, 4096, H), (1, 4096, 8), (8, 2048, H)):
        q, k_cache, v_cache = _randn(B, H, D), _randn(B, L, H_kv, D), _randn(B, L, H_kv, D)
        cache_seqlens = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
        ns = default_num_splits(L, B, H_kv)
        out = torch.empty_like(q)
        mid_o, mid_lse = torch.empty(B, H, ns, D, device="cuda"), torch.empty(B, H, ns, device="cuda")
        best = None
        for BLOCK_N, num_warps, num_stages in ((32, 4, 2), (64, 4, 2), (64, 4, 1), (64, 8, 2), (128, 8, 2), (128, 4, 2),
                                               (32, 4, 3), (64, 8, 3)):
            try:
                ms = graph_ms(lambda: _launch_decode(q, k_cache, v_cache, cache_seqlens, out, mid_o, mid_lse,
                                                BLOCK_N, num_warps, num_stages), rep=20)
            except Exception:  # a config that does not compile is skipped, loudly
                traceback.print_exc()
                continue
            gbps = (2 * B * L * H_kv * D * 2) / ms / 1e6
            rows.append(dict(B=B, L=L, H_kv=H_kv, num_splits=ns, BLOCK_N=BLOCK_N, num_warps=num_warps,
                             num_stages=num_stages, ms=ms, gbps=gbps))
            if best is None or ms < best["ms"]:
                best = rows[-1]
        print(f"  decode_attention B={B} L={L} H_kv={H_kv}: best {best}")
    return rows


def prefill_sweep():
    """Times prefill_attention tile configs; the winner goes into prefill_attention._prefill_config."""
    from rankserve.kernels.prefill_attention import _launch_prefill, prefill_attention_ref
    rows = []
    B, S, H_kv = 1, 2048, H
    r = rank(HIDDEN, HIDDEN)
    Pq, Pk, Pv = _randn(B, S, r), _randn(B, S, r), _randn(B, S, r)
    Uq, Uk, Uv = (_randn(H, D, r, scale=r ** -0.5) for _ in range(3))
    ang = torch.arange(S, device="cuda", dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, D, 2, device="cuda") / D)
    cos, sin = ang.cos().float(), ang.sin().float()
    seqlens = torch.full((B,), S, device="cuda", dtype=torch.int32)
    out = torch.empty(B, S, H, D, device="cuda", dtype=DT)
    k_cache, v_cache = torch.empty(B, S, H_kv, D, device="cuda", dtype=DT), torch.empty(B, S, H_kv, D, device="cuda", dtype=DT)
    o64 = prefill_attention_ref(*(t.double() for t in (Pq, Pk, Pv, Uq, Uk, Uv, cos, sin)), seqlens)[0]
    ob = prefill_attention_ref(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)[0]
    for BLOCK_M, BLOCK_R, num_warps, num_stages in ((64, 32, 8, 1), (64, 64, 8, 1), (64, 32, 4, 1), (128, 32, 8, 1),
                                                    (128, 32, 4, 1), (128, 16, 8, 1), (128, 64, 8, 1)):
        try:
            ms = graph_ms(lambda: _launch_prefill(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, k_cache, v_cache, out,
                                             BLOCK_M, BLOCK_R, num_warps, num_stages), rep=50)
        except Exception:  # a config that does not compile (or runs out of shared memory) is skipped, loudly
            traceback.print_exc()
            continue
        check = _check(out, o64, ob, f"prefill BLOCK_M={BLOCK_M} BLOCK_R={BLOCK_R} warps={num_warps} stages={num_stages}")
        rows.append(dict(B=B, S=S, r=r, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, num_warps=num_warps, num_stages=num_stages,
                         ms=ms, **check))
        print(f"  prefill {rows[-1]}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--only", default="", help="comma-separated case-name prefixes (default: all but gemv_sweep)")
    args = p.parse_args()
    assert torch.cuda.is_available(), "bench/kernels_gpu.py needs a CUDA GPU"
    import triton
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DT), "keep": KEEP, "timing": "triton.testing.do_bench median, L2 flushed between runs"}
    bw = copy_bandwidth_gbps()
    info["copy_gbps"] = bw
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  d2d copy {bw:.0f} GB/s")
    cases = {}
    for B in (1, 4, 8):
        cases[f"lowrank_linear_o_B{B}"] = lambda B=B: case_lowrank_linear(B, HIDDEN, HIDDEN)
        cases[f"lowrank_linear_down_B{B}"] = lambda B=B: case_lowrank_linear(B, INTER, HIDDEN)
    for B in (1, 8):
        cases[f"qkv_rope_mha_B{B}"] = lambda B=B: case_qkv_rope(B, 4096, H)
        cases[f"gate_up_B{B}"] = lambda B=B: case_gate_up(B)
        cases[f"rmsnorm_residual_B{B}"] = lambda B=B: case_rmsnorm(B)
    cases["qkv_rope_gqa8_B1"] = lambda: case_qkv_rope(1, 4096, 8)
    for L in (512, 2048, 8192, 32768):
        cases[f"decode_attention_mha_B1_L{L}"] = lambda L=L: case_decode_attention(1, L, H)
        cases[f"decode_attention_gqa8_B1_L{L}"] = lambda L=L: case_decode_attention(1, L, 8)
    cases["decode_attention_mha_B8_L2048"] = lambda: case_decode_attention(8, 2048, H)
    cases["prefill_attention_mha_B1_S512"] = lambda: case_prefill_attention(1, 512, H)
    cases["prefill_attention_mha_B1_S2048"] = lambda: case_prefill_attention(1, 2048, H)
    cases["prefill_attention_gqa8_B2_S1024"] = lambda: case_prefill_attention(2, 1024, 8)
    cases["decode_step_B1_L2048"] = lambda: case_decode_step(1, 2048)
    cases["gemv_sweep"] = gemv_sweep
    cases["decode_sweep"] = decode_sweep
    cases["prefill_sweep"] = prefill_sweep
    only = [s for s in args.only.split(",") if s]
    results = {}
    for name, fn in cases.items():
        if (only and not any(name.startswith(o) for o in only)) or (not only and name.endswith("_sweep")):
            continue
        t0 = time.time()
        try:
            res = fn()
        except Exception as e:  # report and keep going: one broken kernel must not hide the others
            traceback.print_exc()
            results[name] = {"ok": False, "error": repr(e)}
            print(f"{name:38s} FAILED: {e!r}")
            continue
        if isinstance(res, dict) and "ms" in res:
            res["gbps"] = res["bytes"] / res["ms"] / 1e6
            res["frac_of_copy"] = res["gbps"] / bw
            extra = "  ".join(f"{k} {res[k]:.4f}" for k in ("torch_ms", "torch_dense_ms", "torch_sdpa_ms", "flash_attn_ms",
                                                             "eager_ms", "tflops") if k in res)
            print(f"{name:38s} {'ok ' if res['ok'] else 'BAD'} {res['ms'] * 1e3:9.1f} us  {res['gbps']:7.0f} GB/s "
                  f"({100 * res['frac_of_copy']:3.0f}% of copy)  {extra}  ({time.time() - t0:.0f}s)")
        results[name] = res
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
