"""Host-to-device copies that do not wait for the device.

A copy from pageable host memory waits for every kernel already queued on the stream before it starts (the
driver stages it synchronously), so a small upload in the middle of a step stalls the host until the device
catches up, and the host's next launches no longer overlap the device's work. A copy from pinned memory is queued
like a kernel. PyTorch's pinned-memory cache keeps the host buffer alive until its copy has run.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t (a host tensor) on `device`, queued without waiting for the device; on the CPU, t itself."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t copied into `dst` (a device buffer of its shape), queued without waiting for the device: one host-to-device
    copy, where `dst.copy_(upload(t, ...))` adds a device-to-device one. A t already on dst's device is copied as is.
    Returns dst."""
    if dst.device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return dst.copy_(t, non_blocking=True)
