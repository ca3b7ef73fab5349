"""bench/parse_shrink.py: its scores and top-K are the routers' own (β = 1 is live routing, select_batch), and the
shrunk scores at β = 0 give every prompt the same subset.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_shrink.py -q
"""

import torch

from tiny_factorized import CFG, tiny_model

from rankserve.bench.parse_shrink import all_scores, subsets
from rankserve.workers.model import proj_name
from rankserve.workers.parse import Routers, select_batch


def test_live_scores_match_select_batch_and_beta_zero_is_one_subset():
    model = tiny_model(8)
    lins = model.projections()
    names = [proj_name(0, "q"), proj_name(0, "up")]
    routers = Routers(R={n: torch.randn(8, lins[n].in_features) for n in names}, b={n: torch.randn(8) for n in names},
                      k={n: 3 for n in names}, r_max={n: 8 for n in names}, head={},
                      perm={n: torch.arange(8) for n in names})
    windows = torch.randint(0, CFG.vocab_size, (5, 12))
    live = all_scores(model, routers, windows, 6, batch=2)  # batched in twos: the same as one batch
    assert {n: s.shape for n, s in live.items()} == {n: (5, 8) for n in names}
    assert subsets(live, routers) == select_batch(model, routers, windows[:, :6])
    mean = {n: s.mean(0) for n, s in live.items()}
    fixed = subsets({n: mean[n] + 0.0 * (s - mean[n]) for n, s in live.items()}, routers)
    assert all(f == fixed[0] for f in fixed) and all(len(fixed[0]["k"][n]) == 3 for n in names)
