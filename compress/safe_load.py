"""Loading .pt/.bin files without running pickled code.

`load_torch_file` uses `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers.
A file that needs arbitrary classes (a whole pickled model) is refused unless the caller passes
`trust_pickle=True` (the CLI's `--trust-pickle`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from rankserve.workers.checkpoint import CheckpointError


def load_torch_file(path: str | Path, trust_pickle: bool = False) -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
        if not trust_pickle:
            raise CheckpointError(f"{path} needs arbitrary pickled code to load ({str(e).splitlines()[0][:160]}); "
                                  "refusing. Pass --trust-pickle only if you trust its source") from None
    return torch.load(path, map_location="cpu", weights_only=False)
