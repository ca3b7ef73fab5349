"""bench/parse_shrink.py: its scores and top-K are the routers' own (β = 1 is live routing, select_batch), and the
shrunk scores at β = 0 give every prompt the same subset.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_shrink.py -q
"""

import torch

from rankserve.bench.parse_shrink import all_scores, subsets
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import PROJS, Transformer, proj_name
from rankserve.workers.parse import Routers, select_batch

CFG = ModelConfig(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)


def test_live_scores_match_select_batch_and_beta_zero_is_one_subset():
    torch.manual_seed(0)
    model = Transformer(CFG, {proj_name(0, p): 8 for p in PROJS}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
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
