"""Host time of a joining PARSE row's one-row prefill (`workers/parse_decode.ParseSlots.prefill`): a captured bucket
replayed as the slots do it now (no module runs, so nothing on the slot model is touched) against the same replay
with the slot model's masks and caps repointed at the row and back around it (`_row_mode`: two attribute writes a
routed matrix each way, what every slot prefill did before session 33).

Random svd-llm-shaped PARSE pool at the LLaMA-7B shape (bench/continuous.py's `random_7b(parse=True)`), rank slots of
B rows loaded with overlapping subsets (union ~1.04 K, as routed batches of 8), one prompt length at a time: its
bucket captured first, then the two ways alternated, each call timed from a synced device: `host_ms` until the call
returns (the replay queued), `wall_ms` until the device is done. Their logits must be equal. Also the bare cost of
entering and leaving `_row_mode`.

    python -m rankserve.bench.slot_prefill --out bench/results/slot-prefill-h200.json      # GPU
    python -m rankserve.bench.slot_prefill --cpu-layers 32 --out bench/results/slot-prefill-cpu.json

`--cpu-layers N` runs on the CPU instead, with a tiny random pool of N layers (the 7B shape's matrix count at 32):
there are no graphs, so both ways run the modules in row mode, and the figure it is for is `_row_mode`'s own cost,
which is per module, not per byte.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rankserve.bench.continuous import write_results
from rankserve.workers.parse_decode import ParseSlots


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(fn: Callable[[], torch.Tensor], cuda: bool) -> tuple[float, float, torch.Tensor]:
    """(host ms until fn returns, wall ms until the device is done, its output), from a synced device."""
    _sync(cuda)
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    _sync(cuda)
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3, out


@torch.inference_mode()
def measure(slots: ParseSlots, lengths: list[int], repeats: int = 20, slot: int = 1, seed: int = 0) -> dict[str, Any]:
    """Per prompt length: median (min, max) host and wall ms of slots.prefill as it is ("replay") and with _row_mode
    forced around the replay ("row mode"), alternated; the two outputs' largest difference. `slots` must be loaded
    and have its prefills attached."""
    if slots.prefills is None:
        raise ValueError("the slots have no one-row prefills attached")
    cuda = slots.model.embed.weight.device.type == "cuda"
    cache, vocab = slots.decoder.cache, slots.model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        first = slots.prefill(ids, cache, slot)  # captures the bucket (on the GPU)
        if first is None:
            raise ValueError("the slots' union is wider than the prefill caps: load narrower subsets")
        ways: dict[str, Callable[[], torch.Tensor]] = {"replay": lambda: slots.prefill(ids, cache, slot)}

        def forced() -> torch.Tensor:
            slots.prefills.replays = lambda n: False  # the path before: masks repointed around every call
            try:
                return slots.prefill(ids, cache, slot)
            finally:
                del slots.prefills.replays
        ways["row mode"] = forced
        times: dict[str, dict[str, list[float]]] = {w: {"host": [], "wall": []} for w in ways}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            for w, fn in ways.items():
                host, wall, outs[w] = _timed(fn, cuda)
                times[w]["host"].append(host)
                times[w]["wall"].append(wall)
        row: dict[str, Any] = dict(tokens=n, bucket=slots.prefills.bucket(n), replays=slots.prefills.replays(n))
        for w, t in times.items():
            key = w.replace(" ", "_")
            for kind, xs in t.items():
                row[f"{key}_{kind}_ms"] = round(statistics.median(xs), 3)
                row[f"{key}_{kind}_ms_min_max"] = [round(min(xs), 3), round(max(xs), 3)]
        row["max_abs_logit_diff"] = float((outs["replay"] - outs["row mode"]).abs().max())
        row["argmax_equal"] = bool(outs["replay"].argmax() == first.argmax() == outs["row mode"].argmax())
        rows.append(row)
    enter = []
    for _ in range(repeats * 5):
        t0 = time.perf_counter()
        with slots._row_mode():
            pass
        enter.append((time.perf_counter() - t0) * 1e3)
    return dict(routed_matrices=len(slots.names), batch=slots.B, rows=rows,
                row_mode_alone_ms=round(statistics.median(enter), 3))


def tiny_slots(layers: int = 2, batch: int = 2, union: float = 1.1) -> ParseSlots:
    """Rank slots over a tiny random PARSE pool on the CPU (hidden 64, every matrix r_max 16, K 8), loaded with
    overlapping subsets and given eager one-row prefills."""
    from rankserve.bench.parse_speed import overlapping_subsets
    from rankserve.workers.config import ModelConfig
    from rankserve.workers.fast_decode import DecodeConfig
    from rankserve.workers.model import PROJS, Transformer, proj_name
    from rankserve.workers.parse import Routers
    from rankserve.workers.prefill_graph import PrefillGraphs

    cfg = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ranks = {proj_name(i, p): 16 for i in range(layers) for p in PROJS}
    pool = Transformer(cfg, ranks).eval()
    with torch.no_grad():
        for p in pool.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    routers = Routers(R={}, b={}, k={n: 8 for n in ranks}, r_max=dict(ranks), head={}, perm={})
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=batch, max_seq_len=32, backend="torch", graph="none"))
    slots.load(overlapping_subsets(routers, batch, union, 0))
    slots.prefills = PrefillGraphs(slots.model, 32, graph=False)
    return slots


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# A joining PARSE row's one-row prefill: host time — {res['device']}", "",
             f"torch {res['torch']}; {res['shape']}; rank slots of B = {res['batch']} rows, "
             f"{res['routed_matrices']} routed matrices, union {res['union']} K; median of {res['repeats']} "
             "alternated calls (min-max), each from a synced device. `_row_mode` alone (enter and leave): "
             f"{res['row_mode_alone_ms']} ms.", "",
             "| prompt tokens (bucket) | graph replayed | host ms: as now / row mode | wall ms: as now / row mode | "
             "logits equal |", "| --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        mm = lambda k: f"{r[k]} ({r[k + '_min_max'][0]}-{r[k + '_min_max'][1]})"  # noqa: E731
        equal = "yes" if r["max_abs_logit_diff"] == 0 else r["max_abs_logit_diff"]
        lines.append(f"| {r['tokens']} ({r['bucket']}) | {'yes' if r['replays'] else 'no (eager)'} | "
                     f"{mm('replay_host_ms')} / {mm('row_mode_host_ms')} | {mm('replay_wall_ms')} / "
                     f"{mm('row_mode_wall_ms')} | {equal} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.slot_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="results JSON (markdown beside it, .md)")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, help="prompt lengths (default 16 128 512; on the CPU 16)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--union", type=float, default=1.04, help="the B subsets' union per matrix, in units of K")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cpu-layers", type=int, default=None,
                    help="run on the CPU with a tiny random pool of this many layers (prompts of <= 32 tokens)")
    a = ap.parse_args(argv)
    cpu = a.cpu_layers is not None
    if not cpu and not torch.cuda.is_available():
        print("slot_prefill: needs a CUDA GPU (the graphs are the point), or --cpu-layers N for _row_mode's own "
              "cost on the CPU", file=sys.stderr)
        return 2
    longest = 32 if cpu else 2048
    a.lengths = a.lengths or ([16] if cpu else [16, 128, 512])
    if a.batch < 2 or a.repeats < 1 or not 1.0 <= a.union <= 2.0 or min(a.lengths) < 1 or max(a.lengths) > longest \
            or (cpu and a.cpu_layers < 1):
        print(f"slot_prefill: --batch >= 2, --repeats >= 1, --union in [1, 2], --lengths in 1..{longest}, "
              "--cpu-layers >= 1", file=sys.stderr)
        return 2
    if cpu:
        res = dict(device="CPU", torch=torch.__version__, union=a.union, repeats=a.repeats,
                   shape=f"tiny random pool of {a.cpu_layers} layers (hidden 64), no graphs: both ways run eagerly",
                   **measure(tiny_slots(a.cpu_layers, a.batch, a.union), a.lengths, a.repeats))
        write_results(a.out, res, markdown(res))
        print(markdown(res))
        return 0
    from rankserve.bench.continuous import random_7b
    from rankserve.bench.parse_speed import overlapping_subsets
    from rankserve.workers.align import GPU_ALIGN
    from rankserve.workers.fast_decode import DecodeConfig
    from rankserve.workers.prefill_graph import PrefillGraphs

    eng = random_7b(parse=True)
    S = 1 << (max(a.lengths) - 1).bit_length()
    slots = ParseSlots(eng.model, eng.routers, DecodeConfig(batch_size=a.batch, max_seq_len=max(S, 256),
                                                          backend="triton", graph="step"), align=GPU_ALIGN)
    slots.prefills = PrefillGraphs(slots.model, slots.decoder.cache.max_seq_len)
    slots.load(overlapping_subsets(eng.routers, a.batch, a.union, 0))  # the B rows' union: `union` K
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape="LLaMA-7B, random bf16 weights",
               union=a.union, repeats=a.repeats, **measure(slots, a.lengths, a.repeats))
    write_results(a.out, res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
