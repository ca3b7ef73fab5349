"""How long the fp64 decompositions of `compress` take at the LLaMA-7B projection shapes on a GPU, by route.

`compress --device cuda` whitens each projection (Cholesky of its input Gram) and takes the SVD of W S (fp64). At the
7B width this, not calibration, is most of the time. Timed here for each shape (out, in) of the 7B projections, on
random matrices with a decaying spectrum:

- `cholesky`: the whitening, `torch.linalg.cholesky_ex` of an (in, in) Gram;
- `svd:<driver>`: `torch.linalg.svd(A, full_matrices=False)` with each cuSOLVER driver (default, gesvd, gesvdj,
  gesvda; the CPU has one);
- `eigh`: `compress.factorize.top_singular(..., "eigh")`, the top components from `torch.linalg.eigh` of the
  smaller Gram (AᵀA or AAᵀ), the other side as A v / σ (what `compress --svd-route eigh` runs).

Each route's rank-r truncation (r = the keep-0.6 rank) is checked against the default driver's: the relative
difference of the kept singular values and of the rank-r products U_r Σ_r V_rᵀ.

    python -m rankserve.bench.svd_probe --out bench/results/svd-probe-h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from rankserve.bench.decode import write_json
from rankserve.compress.factorize import rank_for, top_singular

SHAPES = {"q/k/v/o": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)}
DRIVERS = (None, "gesvd", "gesvdj", "gesvda")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable, dev: torch.device, repeats: int) -> tuple[list[float], object]:
    out, secs = None, []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        secs.append(time.perf_counter() - t0)
    return secs, out


def test_matrix(out: int, inp: int, dev: torch.device, seed: int = 0) -> torch.Tensor:
    """(out, in) fp64 with singular values decaying from 1 to 1e-4, like a whitened projection's."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = min(out, inp)
    u, _ = torch.linalg.qr(torch.randn(out, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(inp, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -4, k, dtype=torch.float64)
    return ((u * s) @ v.T).to(dev)


def probe(dev: torch.device, repeats: int, save: Callable[[list[dict]], None] = lambda rows: None,
          drivers: tuple[str | None, ...] = DRIVERS) -> list[dict]:
    """Every route at every shape; `save(rows)` after each row (a cut-off run keeps what it measured). `drivers`:
    the cuSOLVER drivers to time besides the default (None); the CPU has only the default."""
    rows: list[dict] = []
    drivers = (None,) + tuple(d for d in drivers if d is not None) if dev.type == "cuda" else (None,)
    for label, (out, inp) in SHAPES.items():
        A = test_matrix(out, inp, dev)
        r = rank_for(out, inp, 0.6)
        G = A.T @ A + 1e-6 * torch.eye(inp, dtype=torch.float64, device=dev)
        secs, _ = timed(lambda: torch.linalg.cholesky_ex(G), dev, repeats)
        rows.append(dict(shape=label, out=out, inp=inp, route="cholesky", median_s=round(statistics.median(secs), 4)))
        ref = None
        svds = [(f"svd:{d or 'default'}", lambda d=d: torch.linalg.svd(A, full_matrices=False, driver=d))
                for d in drivers]
        routes = svds[:1] + [("eigh", lambda: top_singular(A, r, "eigh"))] + svds[1:]  # the slow drivers last
        for name, fn in routes:
            try:
                secs, (u, s, vh) = timed(fn, dev, repeats)
            except RuntimeError as e:  # a driver that refuses the shape
                rows.append(dict(shape=label, out=out, inp=inp, route=name, error=str(e)[:200]))
                continue
            prod = (u[:, :r] * s[:r]) @ vh[:r]
            row = dict(shape=label, out=out, inp=inp, rank=r, route=name, median_s=round(statistics.median(secs), 4),
                       min_s=round(min(secs), 4))
            if ref is None:
                ref = (s[:r].clone(), prod)
            else:
                row["sigma_rel_diff"] = float(((s[:r] - ref[0]).abs() / ref[0]).max())
                row["product_rel_diff"] = float((prod - ref[1]).norm() / ref[1].norm())
            rows.append(row)
            save(rows)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.svd_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drivers", nargs="*", default=[d for d in DRIVERS if d], choices=[d for d in DRIVERS if d],
                    help="cuSOLVER drivers timed besides the default (none: the default and eigh only)")
    a = ap.parse_args(argv)
    try:
        dev = torch.empty(0, device=a.device).device
    except (RuntimeError, AssertionError, ValueError):
        print(f"svd_probe: --device {a.device!r} is not usable here", file=sys.stderr)
        return 2
    head = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "CPU", torch=torch.__version__)
    probe(dev, a.repeats, lambda rows: write_json(a.out, dict(head, rows=rows)), tuple(a.drivers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
