"""bench/join_probe.py profiles the GPU's fast path only; on a machine without one it says so and exits non-zero."""

import pytest
import torch

from rankserve.bench import join_probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_join_probe_refuses_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        join_probe.main(["--out", str(tmp_path / "probe.json")])
    assert not (tmp_path / "probe.json").exists()
