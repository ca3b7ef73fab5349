import os

import torch

# Triton kernels run under Triton's CPU interpreter when there is no GPU (CI); it must be set before any
# module decorates a kernel, i.e. before test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
