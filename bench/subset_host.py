"""Host time of one PARSE subset at a model's shape: checking it (`parse.validate`, what a worker does with each
rank-cache hit on its engine thread) and converting it to component ids (`parse_batching.subset_ids`, what the rank
slots do once for a joining row). Pure host work: no weights, no device.

    python -m rankserve.bench.subset_host --out bench/results/subset-host-cpu.json          # LLaMA-7B shape
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

from rankserve.bench.decode import plan_ranks
from rankserve.bench.parse_speed import overlapping_subsets
from rankserve.workers.config import preset
from rankserve.workers.parse import Routers, validate
from rankserve.workers.parse_batching import subset_ids


def routers_of(shape: str, keep: float, pool: float = 2.0) -> Routers:
    """Routers carrying only the sizes (K = the svd-llm rank at `keep`, r_max = pool x K capped by the matrix)."""
    cfg = preset(shape)
    ranks, _ = plan_ranks(cfg, "svd-llm", keep)
    shapes = cfg.linear_shapes()
    r_max = {n: min(int(pool * k), min(shapes[n.rsplit(".", 1)[1]])) for n, k in ranks.items()}
    return Routers(R={}, b={}, k=dict(ranks), r_max=r_max, head={}, perm={})


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return round(statistics.median(ts), 2)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shape", default="llama-7b", help="a workers.config preset")
    p.add_argument("--keep", type=float, default=0.6)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    routers = routers_of(a.shape, a.keep)
    subset = overlapping_subsets(routers, 2, 1.05, 0)[0]
    res = dict(shape=a.shape, keep=a.keep, indices=sum(routers.k.values()), matrices=len(routers.k),
               host=platform.processor() or platform.machine(), python=platform.python_version(),
               validate_ms=median_ms(lambda: validate(subset, routers), a.repeats),
               subset_ids_ms=median_ms(lambda: subset_ids(subset, routers), a.repeats), repeats=a.repeats)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
