"""Helpers shared by tests/test_kernels_*.py: device/dtype grid, fresh random inputs, error vs an fp64 reference."""

import os

import torch

if not torch.cuda.is_available():  # before rankserve.kernels imports triton (also when conftest.py is skipped)
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32]  # the interpreter is fp32 only


def fresh_seed() -> int:
    """Seed torch with a new random seed and return it (put it in assertion messages to reproduce)."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", 0)) or int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Fresh N(0, scale²) values on DEVICE, drawn in fp32 then rounded to dtype."""
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def nan_like(shape, dtype: torch.dtype) -> torch.Tensor:
    """Poisoned output buffer: every element the kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def to64(*ts: torch.Tensor):
    """Upcast to fp64 (same values): the reference runs on exactly the kernel's inputs."""
    return tuple(t.double() if t.is_floating_point() else t for t in ts)


def rel_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref64: torch.Tensor, base: torch.Tensor, what: str, slack: float = 0.0,
                 floor_eps: float = 0.0) -> None:
    """out must be finite everywhere and within 4x plain torch's error (base, same dtype) of the fp64 reference.
    slack: extra relative error allowed (a chain of fp32 stages can land a few ulps beyond 4x torch's fused order).
    floor_eps: torch's error counted as at least this many eps of the dtype (on some draws torch lands within an
    ulp or two of the reference, far below its usual error, while the kernel's own spread is wider)."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(out).all(), f"{what}: {(~torch.isfinite(out)).sum().item()} elements unwritten or non-finite"
    tiny = torch.finfo(out.dtype).eps
    err, err_torch = rel_err(out, ref64), max(rel_err(base, ref64), floor_eps * tiny)
    assert err <= 4 * err_torch + tiny + slack, f"{what}: kernel err {err:.3g} > 4 x torch err {err_torch:.3g} + {tiny:.2g}"


def rope_tables(S_max: int, D: int, theta: float = 10000.0):
    """(S_max, D/2) fp32 cos/sin as HF LLaMA builds them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(S_max, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
