"""What the one-launch step's stage synchronization costs: timings with it weakened (GPU diagnostics).

The persistent step kernel (kernels/step_kernel.py) orders its stages with done counters: a program leaving a stage
runs a CTA barrier and a releasing add (`_leave`), a program entering one polls with acquiring reads until the
previous stage's counter is full (`_wait`). This probe swaps those two device functions for weaker ones before the
kernel is first compiled, then times and traces the default config as bench/step_trace does:

    relaxed   _leave is a relaxed add, no barrier, no fence: a counter can fill before the data it stands for lands
              (races: the logits may differ run to run), so the gap to the default is what the fences cost
    nowait    _wait returns at once: no ordering at all (wrong logits); what the weight stream takes on its own,
              the bound on what any synchronization scheme could recover
    warps     not weaker, another release: each of the 4 warps counts itself done with a stage after a warp
              barrier, with no CTA barrier before the add (the waits' targets 4 times larger; GPU only: inline PTX;
              gate/up U's block counts for down V keep their CTA barrier), so a warp done with its rows does not
              wait for the program's other warps; the results stay right
    skip-N    only the waits on a stage of slot N (step_kernel's SLOTS: 0 q/k/v V, 1 q/k/v U, 2 attention, 4 o V,
              5 o U, 6 gate/up V, 8 down V, 9 down U) return at once: the next stage overlaps that one's tail and
              its barrier (wrong logits); what that one boundary costs the step, the bound on what a finer-grained
              dependency or a fusion across it could recover (gate/up U -> down V waits on block counters, not here)

The results are wrong by design: only the timings mean something. The greedy and reproducibility checks of
step_trace still run and say how wrong.

Usage: python -m rankserve.bench.sync_probe --mode relaxed --out bench/results/step-trace-h200-probe-relaxed.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import triton
import triton.language as tl

from rankserve.bench.chain_probe import _release  # its per-warp release (inline PTX), shared with the chain probe
from rankserve.kernels import step_kernel
from rankserve.kernels.step_kernel import PAD, SLOTS  # the counters' spacing (int32s a 128-byte line); slots a layer

_SKIP = tl.constexpr(-1)  # skip-N: the slot whose waiters do not wait (set by weakened before the first compile)
SKIPPABLE = (0, 1, 2, 4, 5, 6, 8, 9)  # slots whose next stage waits through _wait


@triton.jit
def _leave_relaxed(ctr_ptr, sid):
    """Count this program done with stage sid without a barrier or a release: nothing orders its stores first."""
    tl.atomic_add(ctr_ptr + (sid + 1) * PAD, 1, sem="relaxed")


@triton.jit
def _wait_never(ctr_ptr, prev, target, first):
    """Wait for nothing."""
    pass


@triton.jit
def _wait_skipping(ctr_ptr, prev, target, first):
    """_wait, except for waits on a stage of slot _SKIP, which return at once."""
    if first:
        if prev % SLOTS != _SKIP:
            done_ptr = ctr_ptr + (prev + 1) * PAD
            while tl.atomic_add(done_ptr, 0, sem="acquire") < target:
                pass


@triton.jit
def _leave_warps(ctr_ptr, sid):
    """Each warp counts itself done with stage sid: a warp barrier (it orders the warp's stores before its lane 0's
    release add), no CTA barrier (chain_probe's per-warp release)."""
    _release(ctr_ptr + (sid + 1) * PAD, True, True)


@triton.jit
def _wait_warps(ctr_ptr, prev, target, first):
    """_wait for counters that every warp of every program adds to (4 warps: the step's num_warps)."""
    if first:
        done_ptr = ctr_ptr + (prev + 1) * PAD
        while tl.atomic_add(done_ptr, 0, sem="acquire") < target * 4:
            pass


# mode -> the step_kernel functions it swaps
PROBES = {"relaxed": [("_leave", _leave_relaxed)], "nowait": [("_wait", _wait_never)],
          "warps": [("_leave", _leave_warps), ("_wait", _wait_warps)],
          **{f"skip-{n}": [("_wait", _wait_skipping)] for n in SKIPPABLE}}


@contextlib.contextmanager
def weakened(mode: str):
    """step_kernel with its sync functions swapped as `mode` says (before its first compile in this process),
    restored after."""
    if mode not in PROBES:
        raise ValueError(f"sync probe mode must be one of {sorted(PROBES)}, got {mode!r}")
    global _SKIP
    orig = {name: getattr(step_kernel, name) for name, _ in PROBES[mode]}
    for name, fn in PROBES[mode]:
        setattr(step_kernel, name, fn)  # the stage functions look it up in the module's globals when compiled
    skip = _SKIP
    if mode.startswith("skip-"):
        _SKIP = tl.constexpr(int(mode[5:]))
    try:
        yield
    finally:
        for name, fn in orig.items():
            setattr(step_kernel, name, fn)
        _SKIP = skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.sync_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", required=True, choices=sorted(PROBES))
    ap.add_argument("--out", default="bench/results/step-trace-probe.json")
    ap.add_argument("--family", default="svd-llm", choices=["svd-llm", "dobi", "basis-sharing"])
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args(argv)
    from rankserve.bench import step_trace
    with weakened(args.mode):
        return step_trace.main(["--out", args.out, "--family", args.family, "--prompt", str(args.prompt)])


if __name__ == "__main__":
    sys.exit(main())
