"""bench/sync_probe.py: the weakened sync functions stand in for step_kernel's while the probe runs and compile into
the one-launch step (under the CPU interpreter, one program, where ordering cannot matter: same logits as the
real sync). Run alone: python -m pytest -q tests/test_bench_sync_probe.py"""

import pytest
import torch

from rankserve.bench import sync_probe
from rankserve.kernels import step_kernel
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder

from tiny_factorized import CFG, tiny_model


def _one_launch_logits(model) -> torch.Tensor:
    dec = FastDecoder(model, DecodeConfig(batch_size=1, max_seq_len=24, graph="none", one_launch=True))
    torch.manual_seed(1)
    prompt = torch.randint(0, CFG.vocab_size, (1, 5))
    with torch.no_grad():
        out = [dec.prefill(prompt)] + [dec.step(torch.tensor([t])).clone() for t in (3, 7)]
    return torch.stack(out)


def test_probes_swap_the_sync_functions_and_restore_them():
    model = tiny_model(8)
    ref = _one_launch_logits(model)
    leave, wait = step_kernel._leave, step_kernel._wait
    for mode, name, fn in (("relaxed", "_leave", sync_probe._leave_relaxed),
                           ("nowait", "_wait", sync_probe._wait_never),
                           ("skip-2", "_wait", sync_probe._wait_skipping)):
        with sync_probe.weakened(mode):
            assert getattr(step_kernel, name) is fn
            assert sync_probe._SKIP == (2 if mode == "skip-2" else -1)
            got = _one_launch_logits(model)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)  # one program: the same arithmetic in the same order
    assert step_kernel._leave is leave and step_kernel._wait is wait and sync_probe._SKIP == -1
    with sync_probe.weakened("warps"):  # (inline PTX: swapped, not run, on the CPU)
        assert step_kernel._leave is sync_probe._leave_warps and step_kernel._wait is sync_probe._wait_warps
    assert step_kernel._leave is leave and step_kernel._wait is wait
    with pytest.raises(ValueError, match="must be one of"):
        with sync_probe.weakened("fast"):
            pass
