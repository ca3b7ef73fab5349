"""bench/chain_probe.py: both loop shapes compute every segment's W x under each dependency (CPU interpreter), the
segment table chains the step's maps (down V by column blocks, down U waiting for all of them), the counters and the
tagged words end as the protocol says, the sm90 build pipelines the weight stream through every variant, and the CLI
refuses bad input and a machine without a GPU. Run alone: python -m pytest -q tests/test_bench_chain_probe.py"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from rankserve.bench import chain_probe
from rankserve.bench.chain_probe import DEPS, FENCES, MODES, Chain, ChainShape, check, maps, segments

# every map's input within 4 tiles of 16, down V's 176 columns in three blocks (64, 64, 48), ragged items
TINY = ChainShape(hidden=64, rank_qkv=16, rank_o=32, rank_gu=24, rank_d=32, inter=176, layers=2, block_n=4,
                  block_k=16)


def _torch_err(chain: Chain) -> float:
    """PyTorch's own error on the same products (bf16 weights in fp32) against fp64, relative to the largest |y|."""
    worst, top = 0.0, 0.0
    for w_off, n, k, ld, _ in chain.segs:
        w = torch.as_strided(chain.w[w_off:w_off + (n - 1) * ld + k], (n, k), (ld, 1))
        ref = w.double() @ chain.x[:k].double()
        worst = max(worst, float((w.float() @ chain.x[:k] - ref).abs().max()))
        top = max(top, float(ref.abs().max()))
    return worst / top


@pytest.mark.parametrize("dep", DEPS)
@pytest.mark.parametrize("mode", MODES)
def test_every_variant_computes_every_segment(mode, dep):
    chain = Chain(TINY, 1, torch.device("cpu"))
    ref = chain.reference()
    for _ in range(2):  # a second pass: fresh counters, a new epoch
        chain.y.fill_(float("nan"))
        assert check(chain.run(mode, 3, dep), ref) <= 10 * _torch_err(chain) + 1e-6
    assert int(chain.ep) == 2


@pytest.mark.parametrize("fence", FENCES[1:])
@pytest.mark.parametrize("mode", MODES)
def test_every_memory_order_computes_every_segment_and_counts_every_program(mode, fence):
    chain = Chain(TINY, 1, torch.device("cpu"))
    chain.y.fill_(float("nan"))
    assert check(chain.run(mode, 3, "stage", "cta", fence), chain.reference()) <= 10 * _torch_err(chain) + 1e-6
    n_maps = TINY.layers * len(maps(TINY))  # a counter a map: down V (map 6) counted by each of its 3 blocks
    counted = chain.ctr.view(-1, chain_probe.PAD.value)[:, 0]
    assert counted[:n_maps].tolist() == [3 if m % len(maps(TINY)) == 6 else 1 for m in range(n_maps)]


@pytest.mark.parametrize("mode", MODES)
def test_items_are_dealt_over_several_programs(mode):
    chain = Chain(TINY, 3, torch.device("cpu"))  # (the interpreter runs programs one after another: no waits)
    chain.y.fill_(float("nan"))
    assert check(chain.run(mode, 3, "none"), chain.reference()) <= 10 * _torch_err(chain) + 1e-6
    assert chain.total.tolist() == [chain.steps(r) for r in range(3)]


def test_segments_chain_the_steps_maps():
    table, need, n_w, n_y, segs = segments(TINY, torch.device("cpu"))
    per_layer = len(maps(TINY)) + 2  # down V in three column blocks
    assert table.shape == (TINY.layers * per_layer, chain_probe.COLS)
    assert n_w == TINY.layers * sum(n * k for _, n, k in maps(TINY))
    t = table.tolist()
    assert t[0][5] == -1 and t[0][10] == -1 and t[0][11] == -1  # layer 0's first map waits for nothing
    dv = t[6:9]  # down V's blocks: 64, 64 and 48 of its 176 columns, one release counter, reading m's blocks
    assert [r[2] for r in dv] == [64, 64, 48] and [r[0] - dv[0][0] for r in dv] == [0, 64, 128]
    assert {r[7] for r in dv} == {6} and [r[11] - t[5][4] for r in dv] == [0, 64, 128]
    du = t[9]
    assert du[5] == 6 and du[6] == 3  # down U waits for all three blocks (3 P)
    assert du[11] == dv[0][4] and du[12] == 3 and du[13] == TINY.rank_d  # and validates the three partials
    assert t[per_layer][5] == du[7] and t[per_layer][11] == du[4]  # layer 1 reads layer 0's down U
    # the blocks' targets: every item of every segment counted once, in its map's blocks (none in the maps' counters)
    n_maps = TINY.layers * len(maps(TINY))
    assert int(need[:n_maps].sum()) == 0
    items = sum(-(-n // TINY.block_n) for _, n, _, _, _ in segs)
    assert int(need.sum()) == items
    assert n_y == sum(n for _, n, _, _, _ in segs)


def test_local_v_waits_only_in_the_u_maps_and_o_v():
    table, _, _, _, _ = segments(TINY, torch.device("cpu"))
    names = [name for name, _, _ in maps(TINY)]
    names = names[:6] + ["down V"] * 2 + names[6:]  # down V in three column blocks
    t = table.tolist()
    for i, row in enumerate(t):
        local_v = names[i % len(names)] in ("qkv V", "gate/up V", "down V")
        assert row[14] == (-1 if local_v else row[5])  # the U maps and o V wait as the stage dependency does
    assert sum(r[14] >= 0 for r in t) == 5 * TINY.layers  # 5 dependent hops a layer instead of 8
    chain = Chain(TINY, 1, torch.device("cpu"))
    chain.run("loops", 3, "local-v")  # every map still counted, as with the stage dependency
    ctr = chain.ctr.view(-1, chain_probe.PAD.value)[:, 0]
    n_maps = TINY.layers * len(maps(TINY))
    assert ctr[:n_maps].tolist() == [3 if m % len(maps(TINY)) == 6 else 1 for m in range(n_maps)]
    for mode in MODES:  # local-v-sum: each local V segment's rows summed once a program, nothing else
        chain.sums.fill_(7.0)
        chain.run(mode, 3, "local-v-sum")  # (local-v-sum4 is the same on the CPU: it runs in the DEPS test)
        for row, (_, n, _, _, y_off) in zip(t, chain.segs):
            assert bool((chain.sums[y_off:y_off + n] == (1.0 if row[14] < 0 else 0.0)).all())


def test_balanced_shape_gives_every_program_the_same_items():
    s = ChainShape(hidden=64, rank_qkv=16, rank_o=32, rank_gu=24, rank_d=32, inter=176, layers=1, block_n=4,
                   block_k=16, round_rows=3 * 4)
    assert all(n % 12 == 0 and n >= m for (_, n, _), (_, m, _) in zip(maps(s), maps(TINY)))
    chain = Chain(s, 3, torch.device("cpu"))
    assert len(set(chain.total.tolist())) == 1  # as many steps for each of the 3 programs
    chain.y.fill_(float("nan"))
    assert check(chain.run("stream", 3, "none"), chain.reference()) <= 10 * _torch_err(chain) + 1e-6


def test_counters_and_tags_end_as_the_protocols_say():
    chain = Chain(TINY, 1, torch.device("cpu"))
    n_maps = TINY.layers * len(maps(TINY))
    chain.run("stream", 3, "stage")
    ctr = chain.ctr.view(-1, chain_probe.PAD.value)[:, 0]
    assert ctr[:n_maps].tolist() == [3 if m % len(maps(TINY)) == 6 else 1 for m in range(n_maps)]
    chain.run("stream", 3, "blocks")
    ctr = chain.ctr.view(-1, chain_probe.PAD.value)[:, 0]
    nb = len(chain.need)
    assert torch.equal(ctr[n_maps:nb], chain.need[n_maps:]) and int(ctr[:n_maps].abs().sum()) == 0
    chain.run("loops", 3, "spread")  # SPREAD counters a map after the blocks', a program counting into rank % SPREAD
    ctr = chain.ctr.view(-1, chain_probe.PAD.value)[:, 0]
    spread = ctr[nb:].view(n_maps, chain_probe.SPREAD)
    assert spread[:, 0].tolist() == [3 if m % len(maps(TINY)) == 6 else 1 for m in range(n_maps)]
    assert int(spread[:, 1:].abs().sum()) == 0 and int(ctr[:nb].abs().sum()) == 0
    chain.run("loops", 3, "data")
    assert bool(((chain.tag & 0xFFFF) == int(chain.ep)).all())  # every output word written with this pass's epoch
    vals = (chain.tag & -65536).view(torch.float32)
    for _, n, _, _, y_off in chain.segs:  # carrying the fixed x at its row
        rows = torch.arange(n) % chain.x.numel()
        assert torch.equal(vals[y_off:y_off + n], chain.x[rows])


def test_run_rejects_unknown_variants():
    chain = Chain(ChainShape(hidden=16, rank_qkv=16, rank_o=16, rank_gu=16, rank_d=16, inter=32, layers=1,
                             block_n=4, block_k=16), 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="one of"):
        chain.run("warp", 3, "stage")
    with pytest.raises(ValueError, match="one of"):
        chain.run("stream", 3, "flags")
    with pytest.raises(ValueError, match="one of"):
        chain.run("stream", 3, "stage", "grid")
    with pytest.raises(ValueError, match="one of"):
        chain.run("stream", 3, "stage", "cta", "seq_cst")
    with pytest.raises(ValueError, match="GPU only"):
        chain.run("stream", 3, "stage", "warp")


def test_shape_rejects_inputs_wider_than_the_register_tiles():
    with pytest.raises(ValueError, match="4 tiles"):
        ChainShape(block_k=512)  # the 4096-wide hidden input needs 8 tiles of 512


def test_cli_refuses_bad_tiles_and_a_machine_without_a_gpu(capsys, tmp_path):
    assert chain_probe.main(["--tile", "8x1000", "--out", str(tmp_path / "p.json")]) == 2
    assert "--tile" in capsys.readouterr().err
    assert chain_probe.main(["--tile", "eight", "--out", str(tmp_path / "p.json")]) == 2
    assert chain_probe.main(["--per-sm", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert "--per-sm" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    assert chain_probe.main(["--out", str(tmp_path / "p.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_markdown_has_a_row_per_variant_with_its_rounds(tmp_path, capsys):
    row = dict(bytes=int(7.78e9), ms=2.5, TB_s=3.1, of_copy_bw=0.75)
    res = dict(gpu="NVIDIA H200", triton="3.6.0", copy_bw=4.13e12, programs=264, bytes=int(7.78e9),
               shape=dict(layers=32, block_n=8, block_k=1024),
               rows=[dict(mode="loops", stages=3, dep="stage", round=0, **row),
                     dict(mode="loops", stages=3, dep="stage", round=1, **row),
                     dict(mode="stream", stages=3, dep="data", round=0, error="boom")])
    md = chain_probe.markdown(res)
    assert "| a loop a segment | 3 | the previous segment | 2.500 / 2.500 | 3.10 (75%) / 3.10 (75%) |" in md
    assert "| one loop | 3 | its input's tagged words | error | error |" in md
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert chain_probe.main(["--markdown", str(tmp_path / "r.json")]) == 0
    assert "NVIDIA H200" in capsys.readouterr().out


def compile_ptx(mode: str, dep: int, warp: bool = False, fence: int = 0) -> str:
    """PTX of the probe kernel for sm90 at the 7B tiles (needs real JIT functions: run without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kern = chain_probe._loops_kernel if mode == "loops" else chain_probe._stream_kernel
    names = list(inspect.signature(kern.fn).parameters)
    consts = dict(BLOCK_N=8, BLOCK_K=1024, STAGES=3, DEP=dep, ASM=True, SPREAD=8, WARP=warp, FENCE=fence)
    ptrs = {"w_ptr": "*bf16", "seg_ptr": "*i64", "need_ptr": "*i32", "tot_ptr": "*i32", "x_ptr": "*fp32",
            "y_ptr": "*fp32", "ctr_ptr": "*i32", "tag_ptr": "*i32", "sum_ptr": "*fp32", "ep_ptr": "*i32"}
    sig = {n: ptrs.get(n, "i32") for n in names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    return k.asm["ptx"]


def test_sm90_build_streams_weights_through_async_copies_in_every_variant():
    """A CTA barrier inside a pipelined loop stops triton pipelining it: the releases inside the loop are inline PTX
    on a named barrier (or a warp barrier, one count a warp), and every variant's weight tiles still go through
    cp.async (16-byte, L2-only copies). The loops kernel counts itself done after its loop (triton's barrier), as the
    step does; only its per-item block counts are inside."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_bench_chain_probe as t; "
            "out = {f'{m}{d}': t.compile_ptx(m, d) for m in ('loops', 'stream') for d in range(8)}; "
            "out.update({f'{m}w': t.compile_ptx(m, 0, True) for m in ('loops', 'stream')}); "
            "out.update({f'streamf{f}': t.compile_ptx('stream', 0, fence=f) for f in (1, 2)}); print(json.dumps(out))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, f"offline sm90 compile failed:\n{run.stderr[-3000:]}"
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    for key, text in ptx.items():
        lines = text.splitlines()
        assert sum("cp.async.cg.shared.global" in l for l in lines) >= 16, f"{key}: weight stream not pipelined"
        assert not [l for l in lines if "cp.async.ca" in l], key
        named = sum("bar.sync 1, 128" in l for l in lines)
        inside = {"loops1", "stream0", "stream1", "stream4", "stream5", "stream6", "stream7", "streamf1",
                  "streamf2"}  # counting inside the loop
        assert named == (1 if key in inside else 0), f"{key}: {named} named barriers"
        assert ("bar.warp.sync" in text) == key.endswith("w"), key
    assert "red.global.gpu.relaxed.add.f32" in ptx["stream6"]  # local-v-sum's adds, a row each
    assert all("red.relaxed.gpu.global.add.v4.f32" in ptx[f"{m}7"] for m in ("loops", "stream"))  # and 4 rows each
    assert "ld.volatile.global" in ptx["stream3"]  # the tagged words are re-read from memory, not from a register
    # the memory orders: a relaxed add and acquire polls; a release add, relaxed polls and one acquire fence
    assert "red.relaxed.gpu" in ptx["streamf1"] and ".release" not in ptx["streamf1"] and "acquire" in ptx["streamf1"]
    assert "red.release.gpu" in ptx["streamf2"] and "fence.acq_rel.gpu" in ptx["streamf2"]
    assert "acquire" not in ptx["streamf2"]
