"""Batching PARSE requests by subset overlap (workers/parse_batching.py).

Run alone: .venv/bin/python -m pytest tests/test_parse_batching.py -q
"""

import numpy as np
import pytest

from rankserve.workers.parse import Routers
from rankserve.workers.parse_batching import component_cost, group_by_overlap, membership, union_over_k

ROUTERS = Routers(R={}, b={}, k={"l0.q": 2, "l0.down": 3}, r_max={"l0.q": 4, "l0.down": 6}, head={}, perm={})


def _subset(q: list[int], down: list[int]) -> dict:
    return {"v": 1, "k": {"l0.q": q, "l0.down": down}}


def test_membership_marks_each_listed_component():
    m = membership([_subset([0, 3], [1, 2, 5]), _subset([1, 2], [0, 1, 2])], ROUTERS)
    assert m.shape == (2, 10)
    assert np.flatnonzero(m[0]).tolist() == [0, 3, 4 + 1, 4 + 2, 4 + 5]
    assert np.flatnonzero(m[1]).tolist() == [1, 2, 4, 5, 6]
    cost = component_cost(ROUTERS, {"l0.q": (64, 64), "l0.down": (64, 160)})
    assert cost.tolist() == [128.0] * 4 + [224.0] * 6


def test_interleaved_kinds_are_batched_together():
    a, b = _subset([0, 1], [0, 1, 2]), _subset([2, 3], [3, 4, 5])
    subsets = [a, b] * 4  # arrival order alternates two kinds of prompt
    m = membership(subsets, ROUTERS)
    groups = group_by_overlap(m, np.ones(m.shape[1], dtype=np.float32), 4)
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    in_order = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert union_over_k(m, ROUTERS, groups) == 1.0 and union_over_k(m, ROUTERS, in_order) == 2.0


def test_every_request_once_oldest_first_and_batches_bounded():
    rng = np.random.default_rng(0)
    subsets = [_subset(sorted(rng.choice(4, 2, replace=False).tolist()), sorted(rng.choice(6, 3, replace=False).tolist()))
               for _ in range(11)]
    m = membership(subsets, ROUTERS)
    groups = group_by_overlap(m, component_cost(ROUTERS, {"l0.q": (8, 8), "l0.down": (8, 20)}), 3)
    assert sorted(i for g in groups for i in g) == list(range(11))
    assert all(1 <= len(g) <= 3 for g in groups) and [len(g) for g in groups[:-1]] == [3] * (len(groups) - 1)
    seen: set[int] = set()
    for g in groups:  # each batch holds the oldest request not yet batched
        assert min(g) == min(set(range(11)) - seen)
        seen |= set(g)


def test_bad_arguments():
    m = np.zeros((2, 5), dtype=bool)
    with pytest.raises(ValueError, match="batch_size"):
        group_by_overlap(m, np.ones(5, dtype=np.float32), 0)
    with pytest.raises(ValueError, match="cost"):
        group_by_overlap(m, np.ones(4, dtype=np.float32), 2)


def test_membership_checks_lengths_and_ranges():
    with pytest.raises(ValueError, match="l0.down: subset of 2 components, expected 3"):
        membership([_subset([0, 1], [0, 1])], ROUTERS)
    with pytest.raises(ValueError, match="l0.down: component 6 is out of range"):
        membership([_subset([0, 1], [0, 1, 6])], ROUTERS)
    with pytest.raises(ValueError, match="l0.q: component -1 is out of range"):
        membership([_subset([-1, 1], [0, 1, 2])], ROUTERS)


def test_select_together_pulls_a_batch_towards_its_common_components():
    """pull 0 = each row's own top-K; a strong pull gives the whole batch the components most rows picked (union =
    K); in between, the union only shrinks; scores are standardized, so their scale does not matter."""
    import torch

    from rankserve.workers.parse_batching import select_together
    g = torch.Generator().manual_seed(0)
    scores = {"l0.q": torch.randn(5, 4, generator=g), "l0.down": 100 * torch.randn(5, 6, generator=g)}
    own = select_together(scores, ROUTERS, 0.0)
    assert [s["k"]["l0.q"] for s in own] == [sorted(scores["l0.q"][i].topk(2).indices.tolist()) for i in range(5)]
    groups = [list(range(5))]
    unions = [union_over_k(membership(select_together(scores, ROUTERS, p), ROUTERS), ROUTERS, groups)
              for p in (0.0, 0.5, 1.0, 2.0, 100.0)]
    assert unions == sorted(unions, reverse=True) and unions[-1] == 1.0 < unions[0]
    common = select_together(scores, ROUTERS, 100.0)
    counts = torch.zeros(6).scatter_add_(0, torch.tensor([c for s in own for c in s["k"]["l0.down"]]), torch.ones(15))
    assert common[0]["k"]["l0.down"] == sorted(counts.topk(3).indices.tolist())  # the three most picked
    with pytest.raises(ValueError, match="pull"):
        select_together(scores, ROUTERS, -1.0)
