"""Does a U map that skips the components a token did not choose read only what it keeps? (GPU diagnostics)

bench/parse_pertoken.py measures choosing the K components of every matrix per token, from a pool of r_max > K
(the energies |c_i| ||u_i|| of the token's own c = V x). Its cost at decode: V x over all r_max rows, then U's
columns of the kept components only. U is stored [out, r] (row-major, as the step kernel streams it), so one
component is 2 bytes of every row; a run of SEL = 64 consecutive components is one 128-byte line of each row. A
choice made in blocks of 64 components can therefore skip whole lines: the loop's weight load is masked by the
token's block mask, and a masked-off cp.async is issued with no source bytes. This probe times that loop, the stream probe's (a persistent
grid, 2 programs an SM, 32 layers' weights, no synchronization), a layer at a time as the step's U stages: x and the
layer's block mask read once into registers, then one software-pipelined loop over the program's items x tiles, the
tile seen as (BLOCK_N, NBK blocks, 64) so the mask stays constant over each 16-byte copy:

    static      U at the static rank K, no mask (static truncation's read)
    pool        U at r_max = 1.25 K (padded to 64), no mask (reading every component)
    select      U at r_max, each layer's own random choice of round(K / 64) blocks (a token's choice)
    head        U at r_max, the first round(K / 64) blocks (the same bytes, no holes)

and V at r_max rows against V at K rows (the price of the choice: every coefficient is needed to choose). A block
choice loses most of what choosing per component gains (parse_pertoken.py's token-block), so also U stored
transposed, [r, out], where a component is one contiguous row that a per-component choice skips whole:

    T static    transposed U at K, every row
    T pool      transposed U at r_max, every row
    T select    transposed U at r_max, each layer's own random K rows (a token's per-component choice), masked
    T gather    the same K rows, the loop visiting only them (a list of the kept rows a layer)

(each program a chunk of 64 components and a share of the output tiles, its partials added into y by fp32 atomics,
as the chunks must meet somewhere). Each row is checked against torch before it is timed (the masked columns as
zeros), timed from CUDA-graph replays over cold L2 (median), with TB/s over the bytes it needs and its share of the
copy bandwidth measured in the same run.

Usage: python -m rankserve.bench.select_probe --out bench/results/select-probe-h200.json
       python -m rankserve.bench.select_probe --markdown bench/results/select-probe-h200.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

SEL = 64  # components a block: 128 bytes of a bf16 row


@dataclass
class SelectCase:
    name: str
    n: int  # rows a layer: the outputs (U) or the static rank K (V)
    k: int  # columns: the static rank K (U) or the input width (V)
    block_n: int
    nbk: int  # blocks of SEL a tile
    layers: int = 32
    v_side: bool = False  # a V map: r_max grows the rows, not the columns


# the step's U maps at the LLaMA-7B shape, keep 0.6 (svd-llm ranks), with its tiles; and gate/up V
CASES = (
    SelectCase("gate U", 11008, 1792, 8, 16),
    SelectCase("o U", 4096, 1232, 16, 8),
    SelectCase("q/k/v U", 3 * 4096, 1232, 16, 8),
    SelectCase("down U", 4096, 1792, 8, 16),
    SelectCase("gate/up V", 3584, 4096, 2, 64, v_side=True),
)
VARIANTS = ("static", "pool", "select", "head")


def pool_rank(k: int, factor: float = 1.25) -> int:
    """r_max: factor * K rounded up to whole blocks of SEL."""
    return -(-round(factor * k) // SEL) * SEL


@triton.jit
def _tile4(t, a, b, c, d):
    return tl.where(t == 0, a, tl.where(t == 1, b, tl.where(t == 2, c, d)))


@triton.jit
def _keep_tile(keep_ptr, layer, nb, t, NBK: tl.constexpr, MASKED: tl.constexpr):
    blk = t * NBK + tl.arange(0, NBK)
    ok = blk < nb
    if MASKED:
        ok = ok & (tl.load(keep_ptr + layer * nb + blk, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _x_tile(x_ptr, K, t, NBK: tl.constexpr, SEL: tl.constexpr):
    offs = (t * NBK + tl.arange(0, NBK))[:, None] * SEL + tl.arange(0, SEL)[None, :]
    return tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)


@triton.jit
def _select_kernel(w_ptr, x_ptr, keep_ptr, y_ptr, layers, N, K, BLOCK_N: tl.constexpr, NBK: tl.constexpr,
                   SEL: tl.constexpr, STAGES: tl.constexpr, MASKED: tl.constexpr, TILES: tl.constexpr):
    """y[l, n] = sum_k W[l, n, k] x[k] keep[l, k // SEL], a layer at a time as the step's U stages: at a layer's
    start the program holds x and the layer's block mask in registers (up to 4 tiles of NBK * SEL columns: K <=
    TILES * NBK * SEL, TILES <= 4), then walks its items x tiles in one pipelined loop (item g = rank, rank + P,
    ...). The tile is
    (BLOCK_N, NBK, SEL), its mask a block's along the last axis, so each 16-byte copy is all kept or all skipped.
    MASKED=False: keep is not read (every column counts)."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    BLOCK_K: tl.constexpr = NBK * SEL
    nk = tl.cdiv(K, BLOCK_K)
    nb = tl.cdiv(K, SEL)
    items = tl.cdiv(N, BLOCK_N)
    mine = tl.cdiv(tl.maximum(items - rank, 0), P)
    x1 = _x_tile(x_ptr, K, 0, NBK, SEL)
    x2 = x1
    if TILES >= 2:
        x2 = _x_tile(x_ptr, K, 1, NBK, SEL)
    x3 = x1
    if TILES >= 3:
        x3 = _x_tile(x_ptr, K, 2, NBK, SEL)
    x4 = x1
    if TILES >= 4:
        x4 = _x_tile(x_ptr, K, 3, NBK, SEL)
    offs_s = tl.arange(0, NBK)[:, None] * SEL + tl.arange(0, SEL)[None, :]  # (NBK, SEL) within a tile
    for layer in range(layers):
        k1 = _keep_tile(keep_ptr, layer, nb, 0, NBK, MASKED)
        k2 = k1
        if TILES >= 2:
            k2 = _keep_tile(keep_ptr, layer, nb, 1, NBK, MASKED)
        k3 = k1
        if TILES >= 3:
            k3 = _keep_tile(keep_ptr, layer, nb, 2, NBK, MASKED)
        k4 = k1
        if TILES >= 4:
            k4 = _keep_tile(keep_ptr, layer, nb, 3, NBK, MASKED)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.range(0, mine * nk, num_stages=STAGES):
            it = j // nk
            kc = j - it * nk
            offs_n = (rank + it * P) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            offs_k = kc * BLOCK_K + offs_s
            mk = _tile4(kc, k1, k2, k3, k4)[:, None] & (offs_k < K)
            w = tl.load(w_ptr + (layer * N + offs_n).to(tl.int64)[:, None, None] * K + offs_k[None, :, :],
                        mask=mask_n[:, None, None] & mk[None, :, :], other=0.0, eviction_policy="evict_first")
            xk = tl.where(mk, _tile4(kc, x1, x2, x3, x4), 0.0)
            acc += tl.sum(tl.sum(w.to(tl.float32) * xk[None, :, :], axis=2), axis=1)
            if kc == nk - 1:
                tl.store(y_ptr + layer * N + offs_n, acc, mask=mask_n)
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)


@triton.jit
def _transposed_kernel(w_ptr, c_ptr, keep_ptr, idx_ptr, y_ptr, layers, R, N, NK, BLOCK_O: tl.constexpr,
                       CH: tl.constexpr, STAGES: tl.constexpr, MASKED: tl.constexpr, GATHER: tl.constexpr):
    """y[l, :] += sum_i keep[l, i] c[i] Wt[l, i, :] with U stored transposed, Wt (layers * R, N): a component is one
    contiguous row, so a token's choice skips whole rows at any granularity. Each program owns one chunk of CH
    components (rank % chunks) and a share of the output tiles of BLOCK_O columns; at a layer's start it holds its
    chunk's c and mask in registers, then walks its tiles in one pipelined loop, adding each tile's partial into y
    (fp32 atomics: the chunks' partials meet there). y must start at zero. GATHER: the chunks are chunks of the
    layer's NK kept rows, idx (layers, NK) int32 (the loop visits only them; keep is not read)."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    n_rows = NK if GATHER else R
    nch = tl.cdiv(n_rows, CH)
    nt = tl.cdiv(N, BLOCK_O)
    ch = rank % nch
    peers = (P - ch + nch - 1) // nch  # programs of this chunk: ranks ch, ch + nch, ...
    me = rank // nch
    mine = tl.cdiv(tl.maximum(nt - me, 0), peers)  # output tiles me, me + peers, ...
    pos = ch * CH + tl.arange(0, CH)
    okr = pos < n_rows
    for layer in range(layers):
        ok = okr
        rows = pos
        if GATHER:
            rows = tl.load(idx_ptr + layer * NK + pos, mask=okr, other=0)
        elif MASKED:
            ok = ok & (tl.load(keep_ptr + layer * R + pos, mask=okr, other=0) != 0)
        cm = tl.load(c_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        for j in tl.range(0, mine, num_stages=STAGES):
            offs_o = (me + j * peers) * BLOCK_O + tl.arange(0, BLOCK_O)
            oko = offs_o < N
            w = tl.load(w_ptr + (layer * R + rows).to(tl.int64)[:, None] * N + offs_o[None, :],
                        mask=ok[:, None] & oko[None, :], other=0.0, eviction_policy="evict_first")
            part = tl.sum(w.to(tl.float32) * cm[:, None], axis=0)
            tl.atomic_add(y_ptr + layer * N + offs_o, part, mask=oko, sem="relaxed")


def kept_rows(keep: torch.Tensor) -> torch.Tensor:
    """The kept rows of each layer, ascending: (layers, NK) int32 from keep (layers, R) with NK a layer."""
    counts = keep.sum(1)
    if not bool((counts == counts[0]).all()):
        raise ValueError("gather: every layer must keep as many rows")
    return keep.nonzero()[:, 1].to(torch.int32).view(keep.shape[0], int(counts[0])).contiguous()


def run_transposed(wt: torch.Tensor, c: torch.Tensor, keep: torch.Tensor | None, layers: int, block_o: int, ch: int,
                   stages: int, programs: int, y: torch.Tensor | None = None,
                   idx: torch.Tensor | None = None) -> torch.Tensor:
    """One pass over wt (layers * R, N), U stored transposed: y (layers * N,) fp32 = each layer's sum of c[i] wt[i]
    over the components with keep[l, i] != 0 (keep (layers, R) int8, or None for all). y is zeroed first. idx
    (kept_rows(keep), computed outside a timed pass: it syncs with the host): the loop visits only the listed rows
    instead of masking."""
    LR, N = wt.shape
    R = LR // layers
    if keep is not None and keep.shape != (layers, R):
        raise ValueError(f"keep {tuple(keep.shape)}: ({layers}, {R}) wanted")
    if idx is not None and (idx.dim() != 2 or idx.shape[0] != layers or idx.dtype != torch.int32):
        raise ValueError(f"idx: (layers={layers}, NK) int32 wanted, got {tuple(idx.shape)} {idx.dtype}")
    nk = R if idx is None else idx.shape[1]
    if programs < -(-nk // ch):
        raise ValueError(f"{programs} programs for {-(-nk // ch)} chunks of {ch} components: one a chunk at least")
    if y is None:
        y = torch.empty(layers * N, dtype=torch.float32, device=wt.device)
    y.zero_()
    _transposed_kernel[(programs,)](wt, c, keep if keep is not None else wt, idx if idx is not None else wt, y,
                                    layers, R, N, nk, BLOCK_O=block_o, CH=ch, STAGES=stages,
                                    MASKED=keep is not None and idx is None, GATHER=idx is not None, num_warps=4)
    return y


def reference_transposed(wt: torch.Tensor, c: torch.Tensor, keep: torch.Tensor | None, layers: int) -> torch.Tensor:
    LR, N = wt.shape
    cf = c.float()[None].expand(layers, -1)
    if keep is not None:
        cf = cf * keep.float()
    return torch.einsum("lr,lrn->ln", cf, wt.float().view(layers, LR // layers, N)).reshape(-1)


def run(w: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None, layers: int, block_n: int, nbk: int,
        stages: int, programs: int, y: torch.Tensor | None = None) -> torch.Tensor:
    """One pass over w (layers * N, K): y (layers * N,) fp32 with the columns of blocks keep[l] == 0 left out
    (keep (layers, ceil(K / SEL)) int8, or None for all)."""
    LN, K = w.shape
    if K > 4 * nbk * SEL:
        raise ValueError(f"{K} columns: at most 4 tiles of {nbk * SEL} wanted")
    if keep is not None and keep.shape != (layers, -(-K // SEL)):
        raise ValueError(f"keep {tuple(keep.shape)}: ({layers}, {-(-K // SEL)}) wanted")
    if y is None:
        y = torch.zeros(LN, dtype=torch.float32, device=w.device)
    _select_kernel[(programs,)](w, x, keep if keep is not None else w, y, layers, LN // layers, K, BLOCK_N=block_n,
                                NBK=nbk, SEL=SEL, STAGES=stages, MASKED=keep is not None,
                                TILES=-(-K // (nbk * SEL)), num_warps=4)
    return y


def reference(w: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None, layers: int) -> torch.Tensor:
    """torch's fp32 (W ⊙ keep) x, (layers * N,)."""
    LN, K = w.shape
    wf = w.float().view(layers, LN // layers, K)
    if keep is not None:
        wf = wf * keep.float().repeat_interleave(SEL, 1)[:, None, :K]
    return (wf @ x.float()).reshape(-1)


def random_keep(layers: int, blocks: int, kept: int, gen: torch.Generator, device) -> torch.Tensor:
    """(layers, blocks) int8: `kept` blocks a layer, chosen at random."""
    order = torch.rand(layers, blocks, generator=gen).argsort(1)
    return (order < kept).to(torch.int8).to(device)


def _time(row: dict, fn, ref_fn, res: dict, a) -> None:
    """Check fn's pass against torch, time it (stream_probe.measure), append the row and save the results."""
    from rankserve.bench.decode import write_json
    from rankserve.bench.stream_probe import measure
    try:
        ref = ref_fn()
        row["rel_err"] = float((fn() - ref).abs().max() / ref.abs().max())
        if row["rel_err"] > 1e-3:
            raise AssertionError(f"{row['case']} {row['variant']}: relative error {row['rel_err']:.2e} against torch")
        measure(row, fn, res["copy_bw"], a.rep_ms)
    except Exception as e:  # one variant that fails must not lose the others
        row["error"] = repr(e)[:1500]
    res["rows"].append(row)
    print({k: v for k, v in row.items() if k != "shape"}, flush=True)
    write_json(Path(a.out), res)


def markdown(res: dict) -> str:
    lines = [f"{res['gpu']}, triton {res['triton']}, copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, "
             f"{res['programs']} programs, pipeline {res['stages']} deep; one pass over 32 layers (graph replays, "
             "median ms; TB/s over the bytes the variant needs)", "",
             "| map | variant | components read (U; T: rows) / V's rows | ms | TB/s | of copy | vs static |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | | error | | | |")
            continue
        static = next(s for s in res["rows"] if s["case"] == r["case"] and s["variant"] == "static")
        read = (f"{r['rows_a_layer']} rows" if r.get("shape", {}).get("v_side")
                else f"{r['read']} of {r.get('width_of', r['width'])}")
        lines.append(f"| {r['case']} | {r['variant']} | {read} | {r['ms']:.4f} | "
                     f"{r['TB_s']:.2f} | {r['of_copy_bw']:.0%} | {r['ms'] / static['ms']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.select_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/select-probe.json")
    ap.add_argument("--stages", type=int, default=3, help="pipeline depth (the step's: 3)")
    ap.add_argument("--factor", type=float, default=1.25, help="r_max / K")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--block-o", type=int, default=128, help="output columns a tile of transposed U")
    ap.add_argument("--markdown", metavar="JSON", help="render a result JSON as a markdown table and exit")
    a = ap.parse_args(argv)
    if a.markdown:
        import json
        print(markdown(json.loads(Path(a.markdown).read_text())))
        return 0
    if a.factor < 1 or a.stages < 1:
        print("error: --factor >= 1 and --stages >= 1 wanted", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench select_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from rankserve.bench.decode import copy_bandwidth
    dev = torch.device("cuda")
    programs = 2 * torch.cuda.get_device_properties(dev).multi_processor_count
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bw=copy_bandwidth("cuda"), programs=programs, stages=a.stages, factor=a.factor, rows=[])
    print(f"{res['gpu']}: copy {res['copy_bw'] / 1e12:.2f} TB/s, {programs} programs", flush=True)
    gen = torch.Generator().manual_seed(0)
    for case in CASES:
        r = pool_rank(case.k, a.factor)
        kept = round(case.k / SEL)
        if case.v_side:  # V x: K or r_max rows of the input width
            variants = {"static": (case.n, case.k, None), "pool": (pool_rank(case.n, a.factor), case.k, None)}
        else:
            variants = {"static": (case.n, case.k, None), "pool": (case.n, r, None),
                        "select": (case.n, r, random_keep(case.layers, r // SEL, kept, gen, dev)),
                        "head": (case.n, r, (torch.arange(r // SEL) < kept).to(torch.int8).to(dev)
                                 .expand(case.layers, -1).contiguous())}
        for name, (n, width, keep) in variants.items():
            nbk = max(case.nbk, triton.next_power_of_2(-(-width // (4 * SEL))))  # at most 4 tiles a row
            w = torch.randn(case.layers * n, width, device=dev).to(torch.bfloat16)
            x = torch.randn(width, device=dev)
            y = torch.zeros(case.layers * n, dtype=torch.float32, device=dev)
            cols = width if keep is None else int(keep[0].sum()) * SEL
            row = dict(case=case.name, variant=name, shape=asdict(case), rows_a_layer=n, width=width, read=cols,
                       nbk=nbk, bytes=case.layers * n * cols * 2)
            _time(row, lambda w=w, x=x, keep=keep, y=y: run(w, x, keep, case.layers, case.block_n, nbk, a.stages,
                                                             programs, y),
                  lambda w=w, x=x, keep=keep: reference(w, x, keep, case.layers), res, a)
            del w
        if case.v_side:
            continue
        # U stored transposed: a component is a row, skipped whole under a per-component choice
        t_variants = {"T static": (case.k, None), "T pool": (r, None),
                      "T select": (r, (torch.rand(case.layers, r, generator=gen).argsort(1) < case.k)
                                   .to(torch.int8).to(dev))}
        t_variants["T gather"] = t_variants["T select"]
        for name, (rows, keep) in t_variants.items():
            wt = torch.randn(case.layers * rows, case.n, device=dev).to(torch.bfloat16)
            c = torch.randn(rows, device=dev)
            y = torch.zeros(case.layers * case.n, dtype=torch.float32, device=dev)
            n_kept = rows if keep is None else int(keep[0].sum())
            row = dict(case=case.name, variant=name, shape=asdict(case), rows_a_layer=rows, width=case.n,
                       read=n_kept, width_of=rows, block_o=a.block_o, chunk=SEL,
                       bytes=case.layers * n_kept * case.n * 2)
            idx = kept_rows(keep) if name == "T gather" else None
            _time(row, lambda wt=wt, c=c, keep=keep, y=y, idx=idx: run_transposed(
                      wt, c, keep, case.layers, a.block_o, SEL, a.stages, programs, y, idx),
                  lambda wt=wt, c=c, keep=keep: reference_transposed(wt, c, keep, case.layers), res, a)
            del wt
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
