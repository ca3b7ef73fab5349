"""What the decode GEMV compiles to on Hopper, checked offline: triton compiles `_gemv_kernel` for sm90 on this
CPU-only machine (PTX, then ptxas to a cubin), and the PTX is searched for the instructions the design relies on.

- Programmatic dependent launch: the first weight tile is loaded before `griddepcontrol.wait`, i.e. while the
  previous kernel still runs (weights never depend on it), also with PARSE keep masks (read before the wait too).
- 16-divisible row lengths and strides keep the weight loads vectorized (the reason ranks are padded to 16 on
  the GPU, workers/align.py): every global load of the B = 1 kernel is a vector load.

Run alone: .venv/bin/python -m pytest tests/test_kernels_ptx.py
"""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

POINTERS = {"x_ptr": "*fp32", "w_ptr": "*bf16", "y_ptr": "*bf16", "keep_ptr": "*bf16", "klive_ptr": "*i32"}
INTS = ("B", "N", "K", "stride_x", "stride_w", "stride_y", "stride_keep")
ALIGNED = ("x_ptr", "w_ptr", "y_ptr", "keep_ptr", "klive_ptr", "K", "stride_w")  # 16-divisible, as on the GPU


def compile_ptx(keep: bool, pdl: bool) -> str:
    """PTX of `_gemv_kernel` at B = 1 for sm90 (needs real JIT functions: run without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rankserve.kernels.lowrank_linear import _gemv_kernel
    names = list(inspect.signature(_gemv_kernel.fn).parameters)
    consts = dict(B_PAD=1, BLOCK_N=4, BLOCK_K=1024, NORM=False, RESIDUAL=False, KEEP=keep, LIVE=False, PDL=pdl,
                  STAGES=2, SPLIT=1)
    sig = {n: POINTERS.get(n, "i32" if n in INTS else "fp32") for n in names if n not in consts}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    k = triton.compile(ASTSource(_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2})
    return k.asm["ptx"]


def _ptx(keep: bool = False, pdl: bool = True) -> str:
    """compile_ptx in a fresh interpreter: the test session runs the kernels under TRITON_INTERPRET=1."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_kernels_ptx as t; "
            f"print(json.dumps(t.compile_ptx({keep}, {pdl})))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"offline sm90 compile failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("keep", [False, True])
def test_first_weight_tile_is_loaded_before_the_dependency_wait(keep):
    lines = _ptx(keep=keep).splitlines()
    wait = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
    # weights stream with evict_first; 4 rows x 1024 bf16 over 128 threads: four 16-byte loads a thread
    early = [l for l in lines[:min(wait)] if "ld.global" in l and "evict_first" in l] if wait else []
    assert wait and len(early) == 4, f"expected the 4 weight-tile loads before the wait, got {len(early)}"


def test_weight_loads_are_vectorized_with_16_divisible_rows():
    ptx = _ptx(pdl=False)
    loads = [l for l in ptx.splitlines() if "ld.global" in l]
    scalar = [l for l in loads if ".v2" not in l and ".v4" not in l]
    assert loads and not scalar, f"{len(scalar)} of {len(loads)} global loads are scalar"


STEP_POINTERS = {"w_ptr": "*bf16", "meta_ptr": "*i64", "head_ptr": "*bf16", "x_ptr": "*bf16", "t_ptr": "*fp32",
                 "q_ptr": "*bf16", "a_ptr": "*bf16", "m_ptr": "*bf16", "logits_ptr": "*fp32", "kc_ptr": "*bf16",
                 "vc_ptr": "*bf16", "seqlens_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "ctr_ptr": "*i32",
                 "trace_ptr": "*i64", "td_ptr": "*fp32"}
STEP_INTS = ("L", "hidden", "inter", "vocab", "stride_kl", "stride_ks", "stride_kh", "blk_off")


def compile_step_ptx(num_splits: int = 4, kind: str = "ptx", **fields) -> str:
    """PTX of the one-launch step (kernels/step_kernel.py) for sm90 at the default StepKernelConfig (or with the
    given fields) and LLaMA-7B heads; pointers and the 16-divisible sizes carry the alignment triton specializes them
    with on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rankserve.kernels.step_kernel import StepKernelConfig, _step_kernel
    k = StepKernelConfig(**fields)
    names = list(inspect.signature(_step_kernel.fn).parameters)
    consts = dict(H=32, HKV=32, HALF=64, D_PAD=128, NUM_SPLITS=num_splits, SPLITS_PAD=num_splits, BLOCK_H=16,
                  ATT_BLOCK_N=64, DOT_PREC="tf32", STAGES=k.stages, STAGES_U=k.u_stages, STAGES_GU=k.gu_stages,
                  STAGES_DV=k.dv_stages, XO_HIDDEN=k.x_once, XO_INTER=False, WIL=k.wait_in_loop,
                  SPLIT_DV=k.split_down_v, DU_PARTS=3 if k.split_down_v else 1,
                  UT_O=3 if k.u_once else 0, UT_D=2 if k.u_once else 0,  # ranks 1232 / 1792 in 512 / 1024 tiles
                  PREFETCH_ATT=k.att_prefetch,
                  PREFETCH=k.prefetch,
                  TRACE=False, **k.constexprs(True, 64))
    sig = {n: STEP_POINTERS.get(n, "i32" if n in STEP_INTS else "fp32") for n in names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*STEP_POINTERS, *STEP_INTS[1:]]}
    kern = triton.compile(ASTSource(_step_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": k.num_warps, "num_stages": k.stages})
    return kern.asm[kind]


def test_one_launch_step_reads_activations_around_l1_with_vector_copies():
    """The one-launch step: activations other programs of the launch wrote must never come through L1 (an
    L1-allocating cp.async.ca read stale lines on the H200), weights stream as 16-byte copies, not scalar loads,
    and a stage's first weight tiles are on their way before the program waits on the previous stage: copied into
    shared memory by the pipeline's prologue where the wait is inside the loop (the V stages, wait_in_loop), asked of
    L2 elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_kernels_ptx as t; "
            f"print(json.dumps(t.compile_step_ptx()))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"offline sm90 compile failed:\n{run.stderr[-3000:]}"
    lines = json.loads(run.stdout.strip().splitlines()[-1]).splitlines()
    copies = [l for l in lines if "cp.async.c" in l and ".shared.global" in l]
    assert copies and not [l for l in copies if "cp.async.ca" in l], "L1-allocating async copies in the step kernel"
    assert all(" 0x10," in l for l in copies), "async copies narrower than 16 bytes"
    scalar_weights = [l for l in lines if "ld.global" in l and "evict_first" in l and ".b16" in l and ".v" not in l]
    assert not scalar_weights, f"{len(scalar_weights)} scalar 2-byte weight loads"
    # the stage functions are calls (noinline), each a .func of its own: find each one's first poll
    funcs = ptx_functions(lines)
    assert {"_step_kernel", "_qkv_u_stage", "_attention_stage", "_gate_up_stage", "_down_v_blocks"} <= {
        n.split("__")[0] for n in funcs}, f"stage functions not calls: {sorted(funcs)}"
    # q/k/v V, gate/up V and the head share one function (RMSNorm, 2 x 4096 tiles, wait in the loop): 2 tiles of
    # 2 x 4096 bf16 over 128 threads, 8 copies of 16 bytes a tile and thread, before its wait
    [v_norm] = [b for n, b in funcs.items() if n.startswith("_gemv_stage") and "_cTrue_cFalse_c2_c4096_" in n]
    polls = [i for i, l in enumerate(v_norm) if "ld.global.gpu.acquire" in l]
    early = [l for l in v_norm[:polls[0]] if "cp.async.cg" in l and ".shared.global" in l]
    assert len(early) >= 16, f"q/k/v V: {len(early)} weight copies before its wait, 16 expected"
    # o U and down U (u_once: the rank vector in registers, the wait in the loop): 2 tiles of 16 x 512 / 8 x 1024
    for tag in ("_c16_c512_", "_c8_c1024_"):
        [u] = [b for n, b in funcs.items() if n.startswith("_gemv_stage") and tag in n]
        polls = [i for i, l in enumerate(u) if "ld.global.gpu.acquire" in l]
        early = [l for l in u[:polls[0]] if "cp.async.cg" in l and ".shared.global" in l]
        assert len(early) >= 16, f"U stage {tag}: {len(early)} weight copies before its wait, 16 expected"
    # q/k/v U (wait before the loop): its first tiles asked of L2 before its wait
    [qkv_u] = [b for n, b in funcs.items() if n.startswith("_qkv_u_stage")]
    polls = [i for i, l in enumerate(qkv_u) if "ld.global.gpu.acquire" in l]
    assert any("prefetch.global.L2" in l for l in qkv_u[:polls[0]]), "no L2 prefetch before the U wait"
    # attention (att_prefetch): its first cached keys and values asked of L2 before its wait
    [att] = [b for n, b in funcs.items() if n.startswith("_attention_stage")]
    polls = [i for i, l in enumerate(att) if "ld.global.gpu.acquire" in l]
    assert any("prefetch.global.L2" in l for l in att[:polls[0]]), "attention: no L2 prefetch before its wait"


def ptx_functions(lines: list[str]) -> dict[str, list[str]]:
    """The PTX's function definitions (the entry and each .func), by name without the module prefix: their lines.
    Triton 3.6 spells a constexpr argument `___$_12_$__$_cconstexpr_True_` where 3.9 spells `_cTrue`; names are
    brought to 3.9's spelling so the tests read the same on both."""
    starts = [i for i, l in enumerate(lines) if l.startswith((".func", ".visible .entry", ".entry"))]
    out: dict[str, list[str]] = {}
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        mangled = re.sub(r"_*\$_\d+_\$__\$_cconstexpr_", "_c", lines[a].split("(")[0].split()[-1])
        name = mangled.split("_$_")[-1]
        if len(lines[a:b]) > len(out.get(name, [])):  # the definition, not the forward declaration
            out[name] = lines[a:b]
    return out


ROWS_POINTERS = {**{("tz_ptr" if k == "t_ptr" else k): v for k, v in STEP_POINTERS.items()
                    if k != "td_ptr"}, "keep_ptr": "*bf16", "live_ptr": "*i32"}
ROWS_INTS = ("B", "L", "cover", "hidden", "inter", "vocab", "rmax", "stride_keep", "stride_kl", "stride_kb",
             "stride_ks", "stride_kh")


def compile_rows(batch: int = 8, num_splits: int = 4, masked: bool = False):
    """The B > 1 one-launch step (kernels/step_rows.py) compiled for sm90 at the default RowsConfig and LLaMA-7B
    heads, as compile_step_ptx: -> triton's compiled kernel (asm, registers, shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rankserve.kernels.step_rows import RowsConfig, _rows_kernel
    k = RowsConfig()
    names = list(inspect.signature(_rows_kernel.fn).parameters)
    consts = dict(H=32, HKV=32, HALF=64, D_PAD=128, B_PAD=max(16, batch), NUM_SPLITS=num_splits,
                  SPLITS_PAD=num_splits, BLOCK_H=16, ATT_BLOCK_N=64, DOT_PREC="tf32", MASKED=masked,
                  **k.constexprs(True))
    sig = {n: ROWS_POINTERS.get(n, "i32" if n in ROWS_INTS else "fp32") for n in names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ROWS_POINTERS, *ROWS_INTS[3:]]}
    return triton.compile(ASTSource(_rows_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": k.num_warps, "num_stages": k.stages})


def compile_rows_ptx(masked: bool = False) -> dict:
    kern = compile_rows(masked=masked)
    return dict(ptx=kern.asm["ptx"], shared=kern.metadata.shared)


@pytest.mark.parametrize("masked", [False, True])
def test_rows_step_reads_activations_around_l1_with_vector_copies(masked):
    """The B > 1 one-launch step: the rows' activations (written by other programs of the launch) and the weights
    reach shared memory only through 16-byte L2 copies (cp.async.cg), never L1-allocating ones; no scalar 2-byte
    weight loads; the stages are calls; two programs' shared memory fits an SM. Also with PARSE slots' masks."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_kernels_ptx as t; "
            f"print(json.dumps(t.compile_rows_ptx({masked})))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"offline sm90 compile failed:\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    lines = out["ptx"].splitlines()
    copies = [l for l in lines if "cp.async.c" in l and ".shared.global" in l]
    assert copies and not [l for l in copies if "cp.async.ca" in l], "L1-allocating async copies in the rows step"
    assert all(" 0x10," in l for l in copies), "async copies narrower than 16 bytes"
    scalar_weights = [l for l in lines if "ld.global" in l and "evict_first" in l and ".b16" in l and ".v" not in l]
    assert not scalar_weights, f"{len(scalar_weights)} scalar 2-byte weight loads"
    assert {"_rows_kernel", "_rows_gemv", "_rows_qkv_u", "_rows_attention", "_rows_gate_up"} <= {
        n.split("__")[0] for n in ptx_functions(lines)}
    assert out["shared"] <= 110 * 1024, out["shared"]
