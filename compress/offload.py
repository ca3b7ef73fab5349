"""Host offload for the end-to-end (KD) stage of `train-parse`: the dense teacher and the AdamW moments wait in host
memory, so the stage fits a smaller GPU at the same arithmetic.

At the LLaMA-7B width the stage holds the r_max pool (32 GB fp32), the dense teacher (27 GB fp32) and ~3.5 G router
parameters with their gradients and two AdamW moments (56 GB): more than an 80 GB card. Offloaded, the device holds
the pool, the routers and their gradients, the teacher's embedding, norm and head, and one teacher layer at a time.

    teacher = host_teacher(dense_on_cpu, "cuda", torch.float32)  # layers stay on the host, streamed in
    host_step(opt, "cpu")                                         # in place of opt.step()

Both compute what the plain path computes, to the bit: the teacher's layers run on the same device in the same dtype
(a bf16 checkpoint's weights wait in bf16 and are cast on the device, as loading it in fp32 casts them), and
`host_step` runs AdamW's own single-tensor update (foreach=False) one parameter at a time.

Host memory is what limits this at 7B (the lent H100 machine has 125 GiB, and the 7B bench keeps ~30 GB of work files
on a RAM disk), so nothing is pinned: PyTorch's caching host allocator rounds each pinned block up to a power of two,
which by the sizes makes 28 GB of moments ~40 GB (a pinned first try ran out of host memory: bench/results/parse-log.md,
session 44). Copies from pageable memory cost seconds a step instead.
"""

from __future__ import annotations

import torch
from torch import nn


def host_teacher(model: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """Move `model` (a `workers.model.Transformer` on the CPU) to `device`, cast to `dtype` (None: as it is), except
    its decoder layers, whose weights stay in host memory as they are and are copied in (and cast) for each layer's
    forward and dropped after. Inference only: a layer's weights are gone from the device once its forward returns.
    Returns `model`."""
    dev = torch.device(device)
    for name, child in model.named_children():
        if name != "layers":
            child.to(dev, dtype)
    for name, buf in list(model.named_buffers(recurse=False)):
        setattr(model, name, buf.to(dev))  # the rope tables: fp32 whatever the weights' dtype
    for layer in model.layers:
        host = {p: p.data for p in layer.parameters()}

        def bring(mod: nn.Module, args, host=host) -> None:  # noqa: ANN001 (forward pre-hook)
            for p, h in host.items():
                p.data = h.to(dev, dtype)

        def drop(mod: nn.Module, args, out, host=host) -> None:  # noqa: ANN001 (forward hook)
            for p, h in host.items():
                p.data = h

        layer.register_forward_pre_hook(bring)
        layer.register_forward_hook(drop)
    return model


def host_step(opt: torch.optim.Optimizer, host: str | torch.device) -> None:
    """`opt.step()` for an AdamW built with foreach=False whose moments wait on `host` between steps: one parameter
    at a time, its two moments are copied to its device, updated by AdamW's own code and copied back. The device
    holds one parameter's moments at a time; the arithmetic is the single-tensor path's, unchanged (each parameter's
    update depends on its own state and gradient alone)."""
    host = torch.device(host)
    kept = [g["params"] for g in opt.param_groups]
    try:
        for g, params in zip(opt.param_groups, kept):
            for p in params:
                if p.grad is None:
                    continue
                st = opt.state.get(p)
                saved = {}
                if st:
                    for key in ("exp_avg", "exp_avg_sq"):
                        saved[key] = st[key]
                        st[key] = st[key].to(p.device)
                for other in opt.param_groups:  # step updates every group's params: this one alone
                    other["params"] = []
                g["params"] = [p]
                opt.step()
                st = opt.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    h = saved.get(key)
                    if h is None:  # the first step made the moments on the device: give them a home on the host
                        h = torch.empty_like(st[key], device=host)
                    h.copy_(st[key])
                    st[key] = h
    finally:
        for g, params in zip(opt.param_groups, kept):
            g["params"] = params
