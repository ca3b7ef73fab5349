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
                           ("nowait", "_wait", sync_probe._wait_never)):
        with sync_probe.weakened(mode):
            assert getattr(step_kernel, name) is fn
            got = _one_launch_logits(model)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)  # one program: the same arithmetic in the same order
    assert step_kernel._leave is leave and step_kernel._wait is wait
    with pytest.raises(ValueError, match="must be one of"):
        with sync_probe.weakened("fast"):
            pass


def test_spin_wait_compiles_into_every_stage_wait_without_a_barrier_in_its_loop():
    """The spin candidate (GPU only: inline PTX, which the interpreter cannot run): compiled offline for sm90 with
    it swapped in, each stage function that waits on a stage counter polls in a PTX loop with an acquiring read and
    no barrier inside, followed by one CTA barrier."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    code = (f"import sys, json; sys.path.insert(0, {str(here)!r}); import test_kernels_ptx as t; "
            "from rankserve.bench import sync_probe\n"
            "with sync_probe.weakened('spin'):\n    ptx = t.compile_step_ptx()\nprint(json.dumps(ptx))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"offline sm90 compile failed:\n{run.stderr[-3000:]}"
    from test_kernels_ptx import ptx_functions
    funcs = ptx_functions(json.loads(run.stdout.strip().splitlines()[-1]).splitlines())
    waiting = [n for n in funcs if n.startswith(("_gemv_stage", "_qkv_u_stage", "_attention_stage", "_gate_up_stage"))]
    assert len(waiting) >= 6
    for n in waiting:
        body = [l.strip() for l in funcs[n] if l.strip() and not l.strip().startswith(".loc")]
        start = body.index("SPIN:")
        end = next(i for i in range(start, len(body)) if body[i] == "@p bra SPIN;")
        loop = body[start:end]
        assert any(l.startswith("ld.global.gpu.acquire") for l in loop) and not any("bar.sync" in l for l in loop)
        assert any("bar.sync" in l for l in body[end:end + 8]), f"{n}: no barrier after the spin"
