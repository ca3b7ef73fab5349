"""The thin decode path equals the eager runtime: logits per step and greedy tokens, torch and Triton backends.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Run alone:
    .venv/bin/python -m pytest tests/test_fast_decode.py -q
"""

from pathlib import Path

import pytest
import torch

from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import PROJS, Transformer, proj_name

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"
CFG = ModelConfig(vocab_size=53, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _model(kind: str) -> Transformer:
    torch.manual_seed(0)
    ranks, groups = {}, {}
    uneven = {"q": 9, "k": 5, "v": 7, "o": 11, "gate": 13, "up": 6, "down": 10}  # Dobi-like: every rank differs
    wide = dict(uneven, o=15, down=14)  # o U's and down U's rank vectors in 4 register tiles (u_once, CPU widths)
    for i in range(CFG.num_hidden_layers):
        for p in PROJS:
            if kind in ("uneven", "wide"):
                ranks[proj_name(i, p)] = (uneven if kind == "uneven" else wide)[p]
            elif kind == "shared":
                ranks[proj_name(i, p)] = 8
            elif kind == "mixed":  # layer 1 keeps dense attention projections
                ranks[proj_name(i, p)] = None if (i == 1 and p in "qkv") else 8
    if kind == "shared":
        groups = {f"{p}.0-1": [proj_name(0, p), proj_name(1, p)] for p in ("q", "k", "v", "gate", "up")}
    m = Transformer(CFG, ranks, groups)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.eval()


def _assert_steps_close(got: list, ref: list, tol: float = 1e-4) -> None:
    """Logits of every step (prefill first) within `tol` relative to the reference's largest entry."""
    for s, (a, b) in enumerate(zip(got, ref, strict=True)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= tol, f"step {s}: relative error {err}"


def _eager_logits(model, prompt, steps_tokens):
    cfg = model.cfg
    cache = KVCache(cfg.num_hidden_layers, prompt.shape[0], 40, cfg.num_key_value_heads, cfg.head_dim)
    out = [model(prompt, cache, last_only=True)]
    for t in steps_tokens:
        out.append(model(t[:, None], cache, last_only=True))
    return out


@pytest.mark.parametrize("backend,gemv,fuse", [("torch", "auto", True), ("triton", "triton", True),
                                               ("triton", "triton", False), ("triton", "cublas", True)])
@pytest.mark.parametrize("kind", ["uneven", "shared", "mixed"])
def test_steps_match_eager(kind, backend, gemv, fuse):
    model = _model(kind)
    B, P, n = 2, 6, 5
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(n)]
    with torch.no_grad():
        ref = _eager_logits(model, prompt, steps)
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, backend=backend, graph="none", gemv=gemv,
                                              fuse_norm=fuse))
        # the fused path (norms inside the GEMVs, residual adds in epilogues) runs exactly where it should
        assert [l.folded for l in dec.layers] == [fuse and backend == "triton" and gemv == "triton" and l.factorized
                                                  for l in dec.layers]
        got = [dec.prefill(prompt)]
        for t in steps:
            got.append(dec.step(t).clone())
    _assert_steps_close(got, ref)
    assert dec.cache.seqlens.tolist() == [P + n] * B


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_tokens_match_eager_on_bundled_model(backend):
    """64 greedy steps of the fast path give the eager runtime's tokens (fp32, CPU)."""
    model, _ = load_checkpoint(BUNDLED)
    n = 64 if backend == "torch" else 24  # the Triton interpreter is slow on 2 cores
    prompt = torch.tensor([[1, 403, 407]])
    with torch.no_grad():
        cache = KVCache(5, 1, 80, 4, 8)
        logits = model(prompt, cache, last_only=True)
        eager = []
        for _ in range(n):
            eager.append(int(logits.argmax(-1)))
            logits = model(torch.tensor([[eager[-1]]]), cache, last_only=True)
        dec = FastDecoder(model, DecodeConfig(batch_size=1, max_seq_len=80, backend=backend, graph="none"))
        logits = dec.prefill(prompt)
        fast = []
        for _ in range(n):
            fast.append(int(logits.argmax(-1)))
            logits = dec.step(torch.tensor([fast[-1]]))
    assert fast == eager


@pytest.mark.parametrize("kind", ["uneven", "mixed"])
def test_fused_merge_and_persistent_programs_match_eager(kind):
    """attn_merge='fused' (one attention launch, atomic counters) and persistent GEMV programs give eager logits."""
    model = _model(kind)
    B, P, n = 2, 5, 4
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(n)]
    with torch.no_grad():
        ref = _eager_logits(model, prompt, steps)
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, graph="none", fuse_norm=True,
                                              attn_merge="fused", persistent=2))
        got = [dec.prefill(prompt)] + [dec.step(t).clone() for t in steps]
    _assert_steps_close(got, ref)
    assert int(dec.attn_counter.abs().sum()) == 0


@pytest.mark.parametrize("B", [1, 2])
def test_pipelined_gemvs_match_eager(B):
    """gemv_stages=3 (weight tiles streamed through shared memory at B = 1) gives the eager logits."""
    model = _model("uneven")
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(3)]
    with torch.no_grad():
        ref = _eager_logits(model, prompt, steps)
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, graph="none", gemv_stages=3))
        got = [dec.prefill(prompt)] + [dec.step(t).clone() for t in steps]
    _assert_steps_close(got, ref)
    with pytest.raises(ValueError, match="gemv_stages"):
        DecodeConfig(gemv_stages=-1)


@pytest.mark.parametrize("fuse", [False, True])
def test_split_k_v_stages_match_eager(fuse):
    """split_k=2 at B > 1: the V stages add chunk partial sums into their own zeroed scratch (self.tz, cleared at
    the start of every step), so several steps in a row still give the eager logits; fused-norm stages stay whole."""
    model = _model("uneven")
    B, P = 3, 5
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(4)]
    with torch.no_grad():
        ref = _eager_logits(model, prompt, steps)
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, graph="none", split_k=2, fuse_norm=fuse))
        planned = {g for s in dec.splits for g in s}
        assert planned == ({"o", "down"} if fuse else {"qkv", "o", "gu", "down"}) and dec.tz is not None
        got = [dec.prefill(prompt)] + [dec.step(t).clone() for t in steps]
    _assert_steps_close(got, ref)
    assert FastDecoder(model, DecodeConfig(batch_size=1, max_seq_len=40, graph="none", split_k=2)).tz is None  # B = 1: never
    with pytest.raises(ValueError, match="split_k"):
        DecodeConfig(split_k=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_step_greedy_feeds_its_own_argmax(backend):
    """greedy=True: step_greedy() runs on the previous step's argmax (taken inside the step) and gives the eager
    runtime's greedy tokens; step(tokens) still takes explicit tokens and leaves the argmax of its logits."""
    model = _model("uneven")
    B, P, n = 2, 5, 6
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    with torch.no_grad():
        cache = KVCache(CFG.num_hidden_layers, B, 40, CFG.num_key_value_heads, CFG.head_dim)
        lg = model(prompt, cache, last_only=True)
        eager = []
        for _ in range(n):
            eager.append(lg.argmax(-1))
            lg = model(eager[-1][:, None], cache, last_only=True)
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, backend=backend, graph="none",
                                              greedy=True))
        dec.tokens.copy_(dec.prefill(prompt).argmax(-1))
        fast = [dec.tokens.clone()] + [dec.step_greedy().clone() for _ in range(n - 1)]
        assert torch.equal(torch.stack(fast), torch.stack(eager))
        logits = dec.step(torch.tensor([3, 4]))
        assert dec.tokens.tolist() == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="greedy=True"):
        FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, graph="none")).step_greedy()


@pytest.mark.parametrize("kind,splits,split_dv,u_once", [
    ("uneven", 1, True, False), ("shared", 3, True, True), ("uneven", 3, True, True), ("uneven", 3, False, False),
    ("uneven", 1, True, True), ("wide", 3, True, True)])
def test_one_launch_step_matches_eager(kind, splits, split_dv, u_once):
    """one_launch=True (the whole B = 1 step in one persistent kernel, stages ordered by device counters) gives the
    eager logits step after step; with several attention splits (some empty) the last split of each kv head merges
    them; down V by column blocks after gate/up U's per-block counters (split_down_v, the default: a partial a
    block summed by down U) or as one stage; o U and down U reading their input once into register tiles (u_once:
    2, 3 or 4 of them)."""
    from dataclasses import astuple

    from rankserve.kernels.step_kernel import SLOTS, StepKernelConfig
    model = _model(kind)
    prompt = torch.randint(0, CFG.vocab_size, (1, 6))
    steps = [torch.randint(0, CFG.vocab_size, (1,)) for _ in range(3)]
    with torch.no_grad():
        ref = _eager_logits(model, prompt, steps)
        dec = FastDecoder(model, DecodeConfig(batch_size=1, max_seq_len=40, graph="none", num_splits=splits,
                                              one_launch=True,
                                              one_launch_tiles=astuple(StepKernelConfig(
                                                  split_down_v=split_dv, u_once=u_once))))
        got = [dec.prefill(prompt)] + [dec.step(t).clone() for t in steps]
    _assert_steps_close(got, ref)
    if u_once:  # o U's and down U's rank vectors in 2-4 register tiles of 4 (the interpreter's width with u_once)
        tiles = dec.step_kernel.reg_tiles
        o, d = {"uneven": (11, 10), "wide": (15, 14), "shared": (8, 8)}[kind]
        assert (tiles["UT_O"], tiles["UT_D"]) == (-(-o // 4), -(-d // 4))
    # the interpreter runs one program (programs run one after the other there, and a program waits on others'
    # items): it took rank 0 and counted itself done in every stage it ran (slot 3, once a merge stage, never runs);
    # each kv head's merge counter saw its splits
    L, Hkv, n = CFG.num_hidden_layers, CFG.num_key_value_heads, int(SLOTS)
    ctr = dec.step_kernel.ctr
    lines = ctr[:(L * n + 2) * 32].view(-1, 32)[:, 0].tolist()  # stage counters a 128-byte line apart
    assert dec.step_kernel.grid == (1,) and lines[0] == 1
    assert lines[1:] == [1, 1, 1, 0, 1, 1, 1, 1, 1, 1] * L + [1]  # + the head
    merged = splits if splits > 1 else 0
    assert ctr[(L * n + 2) * 32:(L * n + 2) * 32 + L * Hkv].tolist() == [merged] * (L * Hkv)
    # down V by column blocks (split_down_v): each block's counter holds its gate/up U items (the interpreter's tiles:
    # 64-column blocks of the 96 intermediate rows, gate/up items of 16 rows: 4 + 2)
    k = dec.step_kernel
    if split_dv:
        assert ctr[k.blk_off:].view(L, -1, 32)[:, :, 0].tolist() == [[4, 2]] * L
        # the partials of the 2 blocks, each of down V's (rank-padded) rows
        assert k.du_parts == 2 and k.td.numel() == 16 * k.du_parts
    else:
        assert ctr[k.blk_off:].numel() == 0


def test_one_launch_step_with_the_gpu_tiles(monkeypatch):
    """The one-launch step with the tile widths it runs with on the GPU (512 / 1024 / 4096 columns; the interpreter
    normally gets small ones), at ranks like LLaMA-7B's at keep 0.8: o U's rank vector in 4 register tiles of 512
    with a partial last one, two-step gate/up U and down U, one partial column block of down V, 3 attention splits.
    One program under the interpreter (~30 s): the item and tile arithmetic, not the GPU's ordering."""
    from rankserve.kernels.step_kernel import StepKernelConfig
    small = StepKernelConfig.constexprs
    monkeypatch.setattr(StepKernelConfig, "constexprs", lambda self, on_gpu, half: small(self, True, half))
    cfg = ModelConfig(vocab_size=64, hidden_size=2048, intermediate_size=2816, num_hidden_layers=1,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)
    ranks = {"q": 1648, "k": 1648, "v": 1648, "o": 1648, "gate": 1840, "up": 1840, "down": 2000}
    torch.manual_seed(0)
    model = Transformer(cfg, {proj_name(0, p): ranks[p] for p in PROJS}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    prompt = torch.randint(0, cfg.vocab_size, (1, 5))
    step = torch.tensor([3])
    with torch.no_grad():
        cache = KVCache(1, 1, 40, cfg.num_key_value_heads, cfg.head_dim)
        ref = [model(prompt, cache, last_only=True), model(step[:, None], cache, last_only=True)]
        dec = FastDecoder(model, DecodeConfig(batch_size=1, max_seq_len=40, graph="none", one_launch=True,
                                              num_splits=3))
        got = [dec.prefill(prompt), dec.step(step).clone()]
    assert dec.step_kernel.reg_tiles["UT_O"] == 4 and dec.step_kernel.reg_tiles["UT_D"] == 2
    _assert_steps_close([g.reshape(r.shape) for g, r in zip(got, ref)], ref)


@pytest.mark.parametrize("kind,splits,B,cover", [("uneven", 1, 3, 0), ("shared", 3, 2, 8), ("wide", 2, 5, 8)])
def test_rows_step_matches_eager(kind, splits, B, cover):
    """one_launch=True at B > 1 (kernels/step_rows.py: the step for B rows in one persistent kernel, tensor-core
    tiles) gives each row's eager logits step after step, the rows at different positions (prompts of different
    lengths), with 1-3 attention splits merged by the last split of each (row, kv head); with the V stages'
    reduction split into chunks whose partials (and the RMSNorm's sums of squares) add up with atomics (`cover`:
    as if 8 programs ran, the interpreter's one program takes every chunk)."""
    from dataclasses import astuple

    from rankserve.kernels.step_rows import RowsConfig
    from rankserve.kernels.step_kernel import SLOTS
    model = _model(kind)
    lengths = torch.tensor([7, 4, 6, 2, 5][:B])
    prompt = torch.randint(0, CFG.vocab_size, (B, 7))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(3)]
    with torch.no_grad():
        cache = KVCache(CFG.num_hidden_layers, B, 40, CFG.num_key_value_heads, CFG.head_dim)
        ref = [model(prompt, cache, lengths, last_only=True)] + [model(t[:, None], cache, last_only=True)
                                                                  for t in steps]
        dec = FastDecoder(model, DecodeConfig(batch_size=B, max_seq_len=40, graph="none", num_splits=splits,
                                              one_launch=True, one_launch_tiles=astuple(RowsConfig(min_tiles=1))))
        dec.step_kernel.cover = cover
        got = [dec.prefill(prompt, lengths)] + [dec.step(t).clone() for t in steps]
    assert type(dec.step_kernel).__name__ == "RowsStepKernel" and dec.dcfg.fused()
    _assert_steps_close(got, ref)
    # one program under the interpreter: it counted itself done in every stage (slot 3 unused) and the head; each
    # (row, kv head)'s merge counter saw its splits
    L, Hkv, n = CFG.num_hidden_layers, CFG.num_key_value_heads, int(SLOTS)
    ctr = dec.step_kernel.ctr
    lines = ctr[:(L * n + 2) * 32].view(-1, 32)[:, 0].tolist()
    assert dec.step_kernel.grid == (1,) and lines == [1] + [1, 1, 1, 0, 1, 1, 1, 1, 1, 1] * L + [1]
    assert ctr[(L * n + 2) * 32:].tolist() == [splits if splits > 1 else 0] * (L * B * Hkv)


def test_auto_one_launch_decides_before_packing():
    """auto_one_launch keeps a given one_launch and decides None: off on the CPU (and the torch backend), so the
    layers are packed unfolded at B > 1 there; the engine and ParseSlots resolve it before packing (on a Hopper GPU
    masked PARSE slots at B > 1 take the one-launch step too)."""
    from rankserve.workers.fast_decode import auto_one_launch
    m = _model("uneven")
    assert auto_one_launch(DecodeConfig(batch_size=4), m).one_launch is False  # CPU
    assert auto_one_launch(DecodeConfig(batch_size=4, one_launch=True), m).one_launch is True
    d = auto_one_launch(DecodeConfig(batch_size=4, backend="torch"), m)
    assert d.one_launch is False and not d.fused()
    assert DecodeConfig(batch_size=4, one_launch=True).fused() and not DecodeConfig(batch_size=4).fused()
    with pytest.raises(ValueError, match="B <= 16"):
        FastDecoder(m, DecodeConfig(batch_size=17, max_seq_len=40, graph="none", one_launch=True))


def test_one_launch_refuses_what_it_cannot_run():
    from rankserve.kernels.step_kernel import StepKernelConfig, check_aligned
    from rankserve.kernels.step_rows import RowsConfig
    with pytest.raises(ValueError, match="one_launch runs on the triton backend"):
        DecodeConfig(batch_size=2, one_launch=True, backend="torch")
    with pytest.raises(ValueError, match="one_launch runs on the triton backend"):
        DecodeConfig(batch_size=1, one_launch=True, gemv="cublas")
    with pytest.raises(ValueError, match="powers of two"):
        RowsConfig(v=(8, 256))
    # B > 1 is not picked by default (the per-kernel step, unfused norms)
    assert FastDecoder(_model("uneven"), DecodeConfig(batch_size=2, max_seq_len=40, graph="none")).step_kernel is None
    with pytest.raises(ValueError, match="dense layers"):
        FastDecoder(_model("mixed"), DecodeConfig(batch_size=1, max_seq_len=40, graph="none", one_launch=True))
    # the default picks it only where it was measured: a Hopper GPU (never on CPU)
    assert FastDecoder(_model("uneven"), DecodeConfig(batch_size=1, max_seq_len=40, graph="none")).step_kernel is None
    # tiles narrow enough for L1-allocating copies (stale reads), negative prefetch or register caps, unpadded
    # ranks, misalignment
    with pytest.raises(ValueError, match="too narrow"):
        StepKernelConfig(qkv_v=(2, 512), num_warps=4)
    with pytest.raises(ValueError, match="too narrow"):
        StepKernelConfig(num_warps=8)  # U tiles of 512 columns
    with pytest.raises(ValueError, match="powers of two"):
        StepKernelConfig(down_v=(3, 4096))
    with pytest.raises(ValueError, match="prefetch"):
        StepKernelConfig(prefetch=-1)
    with pytest.raises(ValueError, match="maxnreg"):
        StepKernelConfig(maxnreg=300)
    w = torch.zeros(64, dtype=torch.bfloat16)
    check_aligned([w], [16, 32])
    with pytest.raises(ValueError, match="multiples of 16"):
        check_aligned([w], [16, 24])
    with pytest.raises(ValueError, match="32-byte aligned"):
        check_aligned([w[1:]], [16])


@pytest.mark.parametrize("fold", [False, True])
def test_refresh_repacks_as_a_fresh_pack(fold):
    """_Layer.refresh (PARSE slots after a load) writes each V into its rows of the packed factors with the norm
    folded on the way: bit for bit what packing the changed factors anew gives (bf16, the GPU's dtype)."""
    from rankserve.workers.fast_decode import _Layer
    model = _model("uneven").to(torch.bfloat16)
    blk = model.layers[0]
    with torch.no_grad():
        blk.attn_norm.weight.uniform_(0.5, 1.5)
        blk.mlp_norm.weight.uniform_(0.5, 1.5)
        L = _Layer(blk, CFG, fold=fold)
        for p in PROJS:
            lin = getattr(blk.attn if p in ("q", "k", "v", "o") else blk.mlp, p)
            lin.V.copy_(torch.randn_like(lin.V))
        L.refresh()
    fresh = _Layer(blk, CFG, fold=fold)
    assert L.folded == fold
    assert torch.equal(L.Vqkv, fresh.Vqkv) and torch.equal(L.Vgu, fresh.Vgu)


def test_steps_past_max_seq_len_are_refused():
    """After a prefill the decoder counts the steps left on the host: the step that would write a row's K/V at
    position max_seq_len raises (on the GPU it would land in the scratch slot, then in the next row's storage)."""
    model = _model("uneven")
    dec = FastDecoder(model, DecodeConfig(batch_size=2, max_seq_len=9, backend="torch", graph="none"))
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_seq_len 9"):
            dec.prefill(torch.zeros(2, 10, dtype=torch.long))
        assert dec.room is None  # no prefill happened: nothing known, nothing checked
        dec.prefill(torch.ones(2, 6, dtype=torch.long))
        assert dec.room == 3
        for _ in range(3):
            dec.step(torch.ones(2, dtype=torch.long))
        assert dec.cache.seqlens.tolist() == [9, 9] and dec.room == 0
        with pytest.raises(ValueError, match="KV cache is full"):
            dec.step(torch.ones(2, dtype=torch.long))
        assert dec.cache.seqlens.tolist() == [9, 9]  # the refused step ran nothing
        # host lengths: the longest row decides; a prefill starts the count again
        dec.prefill(torch.ones(2, 6, dtype=torch.long), torch.tensor([4, 2]))
        assert dec.room == 5
        dec.rewind(8)  # back (or forward) to a position: the count follows it
        assert dec.cache.seqlens.tolist() == [8, 8] and dec.room == 1
        with pytest.raises(ValueError, match="outside"):
            dec.rewind(10)


def test_timed_repeats_rewind_within_the_cache():
    """bench/decode.py's time_fast steps its decoder through warm-up and every repeat from one prefill, rewinding to
    the prompt in between: the host count of positions must follow the rewinds (a GPU run would stop otherwise)."""
    from rankserve.bench.decode import time_fast
    model = _model("uneven")
    P, n = 6, 5
    dec = FastDecoder(model, DecodeConfig(batch_size=2, max_seq_len=P + n + 8, backend="torch", graph="none"))
    ms = time_fast(dec, P, n, repeats=3)
    assert len(ms) == 3 and all(m > 0 for m in ms)
    assert dec.cache.seqlens.tolist() == [P + n] * 2 and dec.room == 8


def test_kv_cache_counts_its_bytes():
    """KVCache.nbytes: keys and values at every position and the scratch slot (what the engine's budget counts)."""
    c = KVCache(3, 2, 10, 4, 8, dtype=torch.bfloat16)
    assert c.nbytes() == 2 * 3 * 2 * (10 + 1) * 4 * 8 * 2
    assert c.nbytes_per_token() == 2 * 3 * 4 * 8 * 2
