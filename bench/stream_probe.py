"""How fast can one program's GEMV loop stream weights: pointer loads (cp.async) vs TMA (GPU diagnostics).

The one-launch step (kernels/step_kernel.py) streams every weight through a software-pipelined loop of pointer loads
(`tl.load` of a (rows x width) tile, which triton lowers to `cp.async` copies into shared memory, STAGES - 1 tiles
ahead). With no stage waits at all the step still takes 2.60 ms (bench/sync_probe.py): 75 % of the copy bandwidth,
so the loop itself, not only the synchronization, stands between the step and 80 %. This probe times that loop alone
at the step's shapes, against the same loop reading its tiles through a tensor descriptor (TMA bulk copies, one
instruction a box, completion on an mbarrier instead of per-thread copy groups):

    a persistent grid (2 programs an SM, as the step) walks the items of L layers' weights (L * N rows of K
    columns, one contiguous buffer, far larger than L2), item g = rank, rank + P, ... with no synchronization, each
    program's steps (its items x tiles of K) in one `tl.range(..., num_stages=STAGES)` loop; y = W x per layer.

Rows: the mode (ptr / tma / tiled: pointer loads of W stored tile by tile), the shape (a V stage: gate/up V; U
stages: gate U, o U, q/k/v U, down U), the tile and the depth, with the ms of one pass (replayed from a CUDA graph
over cold L2, median, as bench/kernels_gpu times kernels: no launch cost in the figure), the TB/s it streams at, and
its share of the copy bandwidth measured in the same run. Every result is checked against torch's W x before it is
timed. Then the ceiling: pure reads of the largest case's bytes (16 KB tiles, each program a run of consecutive
tiles or tiles dealt one by one as the step deals its items) and torch's own sum.

Usage: python -m rankserve.bench.stream_probe --out bench/results/stream-probe-h200.json
       python -m rankserve.bench.stream_probe --markdown bench/results/stream-probe-h200.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl


@dataclass
class ProbeCase:
    name: str  # the step's stage it stands for
    n: int  # weight rows (outputs) a layer
    k: int  # weight columns (the reduction)
    block_n: int  # rows an item
    block_k: int  # columns a tile
    layers: int = 32


# the step's shapes at the LLaMA-7B shape, keep 0.6 (svd-llm ranks, padded to 16), with its GPU tiles
CASES = (
    ProbeCase("gate/up V", 3584, 4096, 2, 4096),
    ProbeCase("gate U", 11008, 1792, 8, 1024),
    ProbeCase("o U", 4096, 1232, 16, 512),
    # the step's q/k/v U item is 8 dims of each half of a head (rows d and d + 64, the RoPE pairs): two 8 x 512
    # tiles a step; here as 16 contiguous rows
    ProbeCase("q/k/v U", 3 * 4096, 1232, 16, 512),
    ProbeCase("down U", 4096, 1792, 8, 1024),
)
MODES = ("ptr", "tma", "tiled")  # pointer loads of row-major W; TMA; pointer loads of W stored tile by tile


@triton.jit
def _stream_kernel(w_ptr, w_desc, x_ptr, y_ptr, layers, N, K, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, X_ONCE: tl.constexpr, TILED: tl.constexpr = False):
    """y[l, n] = sum_k W[l, n, k] x[k] over this program's items of all layers (item g: layer g // items, rows
    (g % items) * BLOCK_N ...), one pipelined loop over (items x tiles of K), as the step kernel's stages walk
    theirs. TMA: tiles through w_desc (a descriptor over W as (layers * N, K), box BLOCK_N x BLOCK_K). X_ONCE
    (K <= BLOCK_K, the V stages): x read once into registers before the loop, as the step's x_once; otherwise a
    tile a step through the pipeline, as its gate/up U and q/k/v U. TILED: w_ptr holds W tile-major (tile_major:
    every BLOCK_N x BLOCK_K tile one contiguous run, in (layer, item, tile of K) order), so a step reads one run of
    up to 16 KB instead of BLOCK_N row segments."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    nk = tl.cdiv(K, BLOCK_K)
    items = tl.cdiv(N, BLOCK_N)
    mine = tl.cdiv(tl.maximum(layers * items - rank, 0), P)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x1 = tl.load(x_ptr + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < K, other=0.0).to(tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        it = j // nk
        kc = j - it * nk
        g = rank + it * P
        layer = g // items
        offs_n = (g - layer * items) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_k = offs_k < K
        if TMA:  # out-of-bounds columns of the box come back as zeros
            w = w_desc.load([layer * N + (g - layer * items) * BLOCK_N, kc * BLOCK_K])
        elif TILED:  # padding rows / columns of the last tiles are masked: never read
            base = (g.to(tl.int64) * nk + kc) * (BLOCK_N * BLOCK_K)
            w = tl.load(w_ptr + base + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptr + (layer * N + offs_n)[:, None].to(tl.int64) * K + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
        if X_ONCE:
            x = x1
        else:
            x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if kc == nk - 1:
            tl.store(y_ptr + layer * N + offs_n, acc, mask=mask_n & (layer * N + offs_n < layers * N))
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)


@triton.jit
def _read_kernel(w_ptr, out_ptr, tiles, BLOCK: tl.constexpr, STAGES: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """out[rank] = the sum of this program's BLOCK-element tiles of w (`tiles` of them in all): a run of consecutive
    tiles (CONTIGUOUS) or tiles rank, rank + P, ... (the step's way of dealing items); a pure read, no x."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    if CONTIGUOUS:
        q = tiles // P
        first = rank * q + tl.minimum(rank, tiles - q * P)
        mine = q + (rank < tiles - q * P).to(tl.int32)
    else:
        first = rank
        mine = tl.cdiv(tl.maximum(tiles - rank, 0), P)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.range(0, mine, num_stages=STAGES):
        t = tl.where(CONTIGUOUS, first + j, rank + j * P)
        acc += tl.load(w_ptr + t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), eviction_policy="evict_first").to(
            tl.float32)
    tl.store(out_ptr + rank, tl.sum(acc, axis=0))


def read(w: torch.Tensor, block: int, stages: int, programs: int, contiguous: bool) -> torch.Tensor:
    """One pure-read pass over w (numel a multiple of block): each program's partial sum, (programs,) fp32."""
    if w.numel() % block:
        raise ValueError(f"read: {w.numel()} elements are not whole tiles of {block}")
    out = torch.zeros(programs, dtype=torch.float32, device=w.device)
    _read_kernel[(programs,)](w, out, w.numel() // block, BLOCK=block, STAGES=stages, CONTIGUOUS=contiguous,
                              num_warps=4)
    return out


def tile_major(w: torch.Tensor, case: ProbeCase) -> torch.Tensor:
    """w (layers * N, K) stored tile by tile: (layers, items, tiles of K, BLOCK_N, BLOCK_K), zero-padded to whole
    tiles (the kernel masks the padding, so it is never read), flattened."""
    L, bn, bk = case.layers, case.block_n, case.block_k
    items, nk = -(-case.n // bn), -(-case.k // bk)
    p = torch.zeros(L, items * bn, nk * bk, dtype=w.dtype, device=w.device)
    p[:, :case.n, :case.k] = w.view(L, case.n, case.k)
    return p.view(L, items, bn, nk, bk).permute(0, 1, 3, 2, 4).contiguous().view(-1)


def stream(w: torch.Tensor, x: torch.Tensor, case: ProbeCase, mode: str, stages: int, programs: int,
           packed: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
    """One pass of the probe kernel over w (layers * N, K) in `mode` (MODES; "tiled" reads `packed`, tile_major's
    copy of w): y (layers * N,) fp32, written into `y` when given (timed passes: no allocation in the pass)."""
    if mode not in MODES:
        raise ValueError(f"stream: mode {mode!r} is not one of {MODES}")
    if mode == "tiled" and packed is None:
        packed = tile_major(w, case)
    if y is None:
        y = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
    desc = None
    if mode == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(w, [case.block_n, case.block_k])
    _stream_kernel[(programs,)](packed if mode == "tiled" else w, desc, x, y, case.layers, case.n, case.k,
                                TMA=mode == "tma", BLOCK_N=case.block_n, BLOCK_K=case.block_k, STAGES=stages,
                                X_ONCE=case.k <= case.block_k, TILED=mode == "tiled", num_warps=4)
    return y


def check(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest error of y against torch's fp32 W x, relative to the largest |W x|."""
    ref = w.float() @ x.float()
    return float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def measure(row: dict, fn, copy_bw: float, rep_ms: int) -> None:
    """Time fn (one pass over row["bytes"]) as bench/kernels_gpu does: replayed from a CUDA graph, so the launch's
    host cost stays out, over cold-L2 runs, median; fill in ms, TB/s and the share of the copy bandwidth."""
    from rankserve.bench.kernels_gpu import graph_ms
    row["ms"] = graph_ms(fn, rep=rep_ms)
    row["TB_s"] = row["bytes"] / (row["ms"] / 1e3) / 1e12
    row["of_copy_bw"] = row["TB_s"] * 1e12 / copy_bw


def markdown(res: dict) -> str:
    """The probe's rows as a markdown table: a row a (stage, mode), a column a pipeline depth, TB/s (share of the
    copy bandwidth measured in the same run)."""
    depths = sorted({r["stages"] for r in res["rows"]})
    lines = [f"{res['gpu']}, triton {res.get('triton', '?')}, copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, "
             f"{res['programs']} programs; TB/s of one pass over 32 layers (graph replays, median)", "",
             "| stage (tile) | loads | " + " | ".join(f"{d} deep" for d in depths) + " |",
             "| --- | --- |" + " --- |" * len(depths)]
    keys = list(dict.fromkeys((r["case"]["name"], r["mode"]) for r in res["rows"]))
    for name, mode in keys:
        cells = []
        for d in depths:
            rows = [r for r in res["rows"] if (r["case"]["name"], r["mode"], r["stages"]) == (name, mode, d)]
            cells.append(" / ".join("error" if "error" in r else f"{r['TB_s']:.2f} ({r['of_copy_bw']:.0%})"
                                    for r in rows))  # one a round
        case = next(r["case"] for r in res["rows"] if r["case"]["name"] == name)
        tile = f"{case['block_n']} x {case['block_k']} of {case['n']} x {case['k']}"
        loads = {"tma": "TMA", "ptr": "pointer (cp.async)", "tiled": "pointer, W stored tile by tile"}[mode]
        lines.append(f"| {name} ({tile}) | {loads} | " + " | ".join(cells) + " |")
    if res.get("reads"):
        lines += ["", "| pure read of the gate U case's bytes (16 KB tiles) | depth | TB/s |", "| --- | --- | --- |"]
        for r in res["reads"]:
            cell = "error" if "error" in r else f"{r['TB_s']:.2f} ({r['of_copy_bw']:.0%})"
            lines.append(f"| {r['mode']} | {r['stages'] or ''} | {cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.stream_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/stream-probe.json")
    ap.add_argument("--rep-ms", type=int, default=100, help="time spent timing each variant (ms)")
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4, 6], help="pipeline depths to time")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="how the loop reads its tiles")
    ap.add_argument("--cases", nargs="+", default=[c.name for c in CASES], metavar="NAME",
                    help=f"stages to probe, of: {', '.join(c.name for c in CASES)}")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved")
    ap.add_argument("--no-reads", action="store_true", help="skip the pure-read ceiling")
    ap.add_argument("--markdown", metavar="JSON", help="render a result JSON as a markdown table and exit")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if c.name in args.cases]
    unknown = set(args.cases) - {c.name for c in CASES}
    if unknown:
        print(f"error: unknown case(s) {sorted(unknown)}; known: {[c.name for c in CASES]}", file=sys.stderr)
        return 2
    if args.markdown:
        import json
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if not torch.cuda.is_available():
        print("error: bench stream_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from rankserve.bench.decode import copy_bandwidth, write_json
    dev = torch.device("cuda")
    programs = 2 * torch.cuda.get_device_properties(dev).multi_processor_count
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bw=copy_bandwidth("cuda"), programs=programs, rows=[])
    print(f"{res['gpu']}: copy {res['copy_bw'] / 1e12:.2f} TB/s, {programs} programs", flush=True)
    for case in cases:
        w = torch.randn(case.layers * case.n, case.k, device=dev).to(torch.bfloat16)
        x = torch.randn(case.k, device=dev)
        packed = tile_major(w, case) if "tiled" in args.modes else None
        y = torch.zeros(w.shape[0], dtype=torch.float32, device=dev)
        nbytes = w.numel() * w.element_size()
        for rnd in range(args.rounds):
            for mode in args.modes:
                for stages in args.stages:
                    row = dict(case=asdict(case), mode=mode, stages=stages, round=rnd, bytes=nbytes)
                    try:
                        def fn(mode=mode, stages=stages, w=w, x=x, packed=packed, y=y):
                            return stream(w, x, case, mode, stages, programs, packed, y)
                        if rnd == 0:
                            row["rel_err"] = check(w, x, fn())
                        measure(row, fn, res["copy_bw"], args.rep_ms)
                    except Exception as e:  # one variant that does not compile must not lose the others
                        row["error"] = repr(e)[:1500]
                    res["rows"].append(row)
                    print({k: v for k, v in row.items() if k != "case"}, case.name, flush=True)
                    write_json(Path(args.out), res)
    if args.no_reads:
        return 0
    # the ceiling: pure reads of the largest case's bytes (no x, no per-row sums), 16 KB tiles, dealt to the programs
    # in runs of consecutive tiles or one by one as the step deals its items; and torch's own sum
    case = max(CASES, key=lambda c: c.n * c.k)
    w = torch.randn(case.layers * case.n, case.k, device=dev).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    ref = float(w.double().sum())
    variants = [(f"read, {'runs' if c else 'dealt'}", lambda d=d, c=c: read(w, 8192, d, programs, c), d)
                for c in (True, False) for d in args.stages]
    variants.append(("torch sum", lambda: w.sum(dtype=torch.float32).reshape(1), 0))
    for mode, fn, stages in variants:
        row = dict(mode=mode, stages=stages, bytes=nbytes)
        try:
            row["rel_err"] = abs(float(fn().double().sum()) - ref) / float(w.double().abs().sum())
            measure(row, fn, res["copy_bw"], args.rep_ms)
        except Exception as e:
            row["error"] = repr(e)[:1500]
        res.setdefault("reads", []).append(row)
        print(row, flush=True)
        write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
