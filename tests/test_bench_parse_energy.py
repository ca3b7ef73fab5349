"""bench/parse_energy.py's energy hooks: per row, mean over the first tokens of ‖U[:, i]‖² (V[i] · x)².

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_energy.py -q
"""

import torch

from tiny_factorized import CFG, tiny_model

from rankserve.bench.parse_energy import Energies
from rankserve.workers.model import proj_name


def test_energies_match_a_direct_computation():
    model = tiny_model(6)
    names = [proj_name(0, "q"), proj_name(0, "down")]
    seen = {}
    hooks = [model.projections()[n].register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, i[0]))
             for n in names]
    energies = Energies(model, names)
    x = torch.randint(0, CFG.vocab_size, (2, 10))
    got = energies(x, 4)
    energies.close()
    for h in hooks:
        h.remove()
    assert set(got) == set(names)
    for n in names:
        lin = model.projections()[n]
        z = seen[n][:, :4] @ lin.V.T  # (2, 4, r): the first 4 tokens only
        ref = (z ** 2).mean(1) * (lin.U ** 2).sum(0)
        torch.testing.assert_close(got[n], ref)
    assert not any(model.projections()[n]._forward_hooks for n in names)  # close() removed them
