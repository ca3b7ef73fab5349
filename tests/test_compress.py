"""Factorization: ranks, SVD / SVD-LLM / Basis Sharing math, whitening fallbacks, the compress pipeline.

Run alone: .venv/bin/python -m pytest tests/test_compress.py -q -s   (-s prints the perplexities)
A few seconds on 2 cores (about 1 s idle); the stories260K comparison is marked slow (-m "not slow" skips it).
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rankserve.compress.calibrate import INPUT_OF, _accumulate, calibrate, calibration_batches, layer_grams
from rankserve.compress.evaluate import perplexity
from rankserve.compress.factorize import (compress_model, factorized, rank_for, shared_basis_factors, shared_rank_for,
                                          resolve_route, svd_factors, svd_llm_factors, top_singular,
                                          whiten)
from rankserve.workers.checkpoint import CheckpointError, Manifest, load_checkpoint, save_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import Transformer, proj_name
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
HELD_OUT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"  # WikiText-2 raw test, first 47 kB
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _calib_loss(W, U, V, X):  # ‖(W − U V) Xᵀ‖_F, the loss SVD-LLM minimizes
    return float(((W - U @ V) @ X.T).norm())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random fp32 LLaMA (3 layers, GQA) saved as a native checkpoint with stories260K's tokenizer."""
    cfg = ModelConfig(vocab_size=512, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    out = tmp_path_factory.mktemp("tiny") / "dense"
    return save_checkpoint(out, model, Manifest(family="dense", ranks={}, source="random"), tokenizer_dir=STORIES)


# --- ranks ---------------------------------------------------------------------------------------
def test_ranks_match_published_llama7b_ranks():
    # SVD-LLM keep 0.8 (attn 1638, MLP 2388) and Basis Sharing 20 % removed (q/k/v 2184, gate/up 2762): §2.2, §5.3
    assert rank_for(4096, 4096, 0.8) == 1638 and rank_for(11008, 4096, 0.8) == 2388 and rank_for(4096, 11008, 0.8) == 2388
    assert shared_rank_for(4096, 4096, 2, 0.8) == 2184 and shared_rank_for(11008, 4096, 2, 0.8) == 2762
    assert rank_for(4096, 4096, 0.6) == 1228 and shared_rank_for(11008, 4096, 2, 0.6) == 2072


def test_ranks_dense_cases():
    assert rank_for(64, 64, 1.0) is None  # keep 1: the dense matrix fits the budget
    assert rank_for(1, 8, 0.5) is None  # rank 1 holds 9 > 8 parameters
    assert rank_for(64, 64, 0.999) == 31  # 31·128 < 64·64: factorized
    assert rank_for(3, 1000, 0.01) == 1  # clamped up to 1
    assert shared_rank_for(32, 64, 4, 0.95) == 32  # clamped to min(out, in): the checkpoint bounds member ranks


# --- the math --------------------------------------------------------------------------------------
def test_svd_full_rank_is_exact():
    W = torch.randn(48, 32, dtype=torch.float64)
    U, V = svd_factors(W, 32)
    assert U.shape == (48, 32) and V.shape == (32, 32)
    assert _rel(U @ V, W) < 1e-12


def test_svd_llm_full_rank_reproduces_w_and_truncation_is_whitened_optimal():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(40, 24, generator=g, dtype=torch.float64)
    X = torch.randn(500, 24, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, 24, dtype=torch.float64)
    wh = whiten(X.T @ X)
    assert wh.kind == "cholesky"
    U, V = svd_llm_factors(W, wh, 24)
    assert _rel(U @ V, W) < 1e-10
    # truncation-aware: the calibration loss at rank r is the norm of the dropped singular values of W S
    r = 8
    U, V = svd_llm_factors(W, wh, r)
    s = torch.linalg.svdvals(W @ wh.S)
    assert abs(_calib_loss(W, U, V, X) - float(s[r:].norm())) < 1e-8 * float(s.norm())
    Us, Vs = svd_factors(W, r)
    assert _calib_loss(W, U, V, X) < _calib_loss(W, Us, Vs, X)  # whitening beats plain SVD on its own loss


def test_whitening_fallbacks():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(20, 16, generator=g, dtype=torch.float64)
    X = torch.randn(300, 16, generator=g, dtype=torch.float64)
    X[:, 5] = 0  # a dead input channel: XᵀX is exactly singular
    wh = whiten(X.T @ X)
    assert wh.kind == "damped" and wh.damping > 0
    assert _rel(wh.S @ wh.S.T, X.T @ X + wh.damping * torch.eye(16, dtype=torch.float64)) < 1e-12
    U, V = svd_llm_factors(W, wh, 16)
    assert torch.isfinite(V).all() and _rel(U @ V, W) < 1e-8
    low = torch.randn(6, 16, generator=g, dtype=torch.float64)  # fewer tokens than inputs: rank 6
    wh = whiten(low.T @ low)
    assert wh.kind == "damped"
    U, V = svd_llm_factors(W, wh, 6)
    assert torch.isfinite(U).all() and torch.isfinite(V).all()
    assert _calib_loss(W, U, V, low) < 1e-6 * float((W @ low.T).norm())  # rank 6 suffices on 6 tokens
    G = torch.diag(torch.tensor([1.0, 2.0, 3.0, -1.0], dtype=torch.float64))  # not PSD beyond any damping
    wh = whiten(G)
    assert wh.kind == "eigh"
    M = torch.randn(4, 3, generator=g, dtype=torch.float64)
    assert _rel(wh.unwhiten(M), torch.linalg.solve(wh.S.T, M)) < 1e-12
    assert whiten(torch.zeros(4, 4)).kind == "identity"
    with pytest.raises(ValueError, match="inf/nan"):
        whiten(torch.full((3, 3), float("nan")))


def test_shared_basis_full_rank_reproduces_members():
    g = torch.Generator().manual_seed(3)
    Ws = [torch.randn(16, 24, generator=g, dtype=torch.float64) for _ in range(2)]
    X = torch.randn(400, 24, generator=g, dtype=torch.float64)
    V, Us = shared_basis_factors(Ws, whiten(X.T @ X), 24)
    assert V.shape == (24, 24) and [U.shape for U in Us] == [(16, 24)] * 2
    for U, W in zip(Us, Ws):
        assert _rel(U @ V, W) < 1e-10
    # truncated: the group's summed calibration loss is the dropped singular values of Sᵀ W_cat
    k = 10
    wh = whiten(X.T @ X)
    V, Us = shared_basis_factors(Ws, wh, k)
    s = torch.linalg.svdvals(wh.S.T @ torch.cat([W.T for W in Ws], dim=1))
    loss = sum(_calib_loss(W, U, V, X) ** 2 for W, U in zip(Ws, Us)) ** 0.5
    assert abs(loss - float(s[k:].norm())) < 1e-8 * float(s.norm())


def test_eigh_route_gives_the_svd_routes_truncation():
    """`top_singular(..., "eigh")` (eigensolve of the smaller Gram) keeps the same top-r triplets as the SVD, up to
    the singular vectors' signs, on both orientations; each factorization gives the same products."""
    g = torch.Generator().manual_seed(4)
    for m, n in ((60, 36), (36, 60)):
        A = torch.randn(m, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n, dtype=torch.float64)
        u, s, vh = top_singular(A, 12, "eigh")
        ur, sr, vhr = top_singular(A, 12, "svd")
        assert u.shape == (m, 12) and s.shape == (12,) and vh.shape == (12, n)
        assert torch.allclose(s, sr, rtol=1e-12)
        assert _rel((u * s) @ vh, (ur * sr) @ vhr) < 1e-10
        assert torch.allclose(u.T @ u, torch.eye(12, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(vh @ vh.T, torch.eye(12, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(s, torch.linalg.svdvals(A)[:12], rtol=1e-10)
    W = torch.randn(40, 24, generator=g, dtype=torch.float64)
    X = torch.randn(500, 24, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, 24, dtype=torch.float64)
    wh = whiten(X.T @ X)
    for r in (8, 24):
        U, V = svd_llm_factors(W, wh, r, "eigh")
        Ur, Vr = svd_llm_factors(W, wh, r)
        assert _rel(U @ V, Ur @ Vr) < 1e-9
    Ws = [torch.randn(16, 24, generator=g, dtype=torch.float64) for _ in range(2)]
    V, Us = shared_basis_factors(Ws, wh, 10, "eigh")
    Vr, Urs = shared_basis_factors(Ws, wh, 10)
    for U, Ur in zip(Us, Urs):
        assert _rel(U @ V, Ur @ Vr) < 1e-9
    with pytest.raises(ValueError, match="unknown SVD route"):
        top_singular(W, 4, "qr")
    assert resolve_route("auto", "cpu") == "svd" and resolve_route("auto", "cuda:0") == "eigh"
    assert resolve_route("svd", "cuda") == "svd" and resolve_route("eigh", "cpu") == "eigh"


def test_eigh_route_falls_back_to_the_svd_where_squaring_would_lose_digits():
    """A kept σ below 1e-5·σ_1 would come out of AᵀA with few correct digits: the route takes the SVD instead."""
    g = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(30, 10, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(20, 10, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -9, 10, dtype=torch.float64)
    A = (u * s) @ v.T
    _, got, _ = top_singular(A, 8, "eigh")
    assert torch.allclose(got, s[:8], rtol=1e-6)  # σ_8 = 1e-7: from AᵀA alone it would be noise


# --- calibration -----------------------------------------------------------------------------------
def test_a_short_calibration_text_is_reported(tiny_dir, tmp_path, capsys):
    """Fewer tokens than allowed: a line says how many; the bar counts the layers run over them."""
    model, _ = load_checkpoint(tiny_dir)
    tok = Tokenizer.load(tiny_dir)
    short = tmp_path / "short.txt"
    short.write_text(CALIB.read_text()[:3000])
    stats = calibrate(model, tok, short, max_tokens=100_000, seq_len=128, progress=True)
    err = capsys.readouterr().err
    assert 0 < stats.tokens < 100_000
    assert f"calibration text short.txt gives {stats.tokens} tokens (of the 100000 allowed)" in err
    assert f"{model.cfg.num_hidden_layers}/{model.cfg.num_hidden_layers}" in err


def test_calibration_grams(tiny_dir):
    model, _ = load_checkpoint(tiny_dir)
    tok = Tokenizer.load(tiny_dir)
    stats = calibrate(model, tok, CALIB, max_tokens=1000, seq_len=128, batch_size=3, progress=False)
    assert stats.tokens == 1000  # 7 full windows of 128 and one of 104
    g = stats.grams
    assert g[proj_name(0, "q")] is g[proj_name(0, "k")] is g[proj_name(0, "v")]
    assert g[proj_name(2, "gate")] is g[proj_name(2, "up")] and g[proj_name(2, "down")].shape == (80, 80)
    # the Gram of layer 0's attention input, by hand: RMSNorm of the embeddings of the same 1000 tokens
    ids = torch.tensor(tok.encode(CALIB.read_text(), bos=True)[:1000])
    with torch.no_grad():
        x = model.layers[0].attn_norm(model.embed(ids)).double()
    assert _rel(g[proj_name(0, "q")], x.T @ x) < 1e-5
    assert all(t.dtype == torch.float64 for t in g.values())


def test_layer_by_layer_grams_equal_the_whole_model_forward(tiny_dir):
    """calibrate runs one layer at a time over every window; its Grams are the hooks' on the model's own forward,
    to the bit, windows of two lengths included."""
    model, _ = load_checkpoint(tiny_dir)
    tok = Tokenizer.load(tiny_dir)
    stats = calibrate(model, tok, CALIB, max_tokens=1000, seq_len=128, batch_size=3, progress=False)
    batches, _ = calibration_batches(model, tok, CALIB, 1000, 128, 3)
    assert [tuple(b.shape) for b in batches] == [(3, 128), (3, 128), (1, 128), (1, 104)]
    ref, handles = {}, []
    for i, blk in enumerate(model.layers):
        for p in ("q", "o", "gate", "down"):
            lin = getattr(blk.attn if p in ("q", "o") else blk.mlp, p)
            ref[proj_name(i, p)] = torch.zeros(lin.in_features, lin.in_features, dtype=torch.float64)
            handles.append(lin.register_forward_hook(_accumulate(ref[proj_name(i, p)])))
    with torch.inference_mode():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()
    for name, g in stats.grams.items():
        layer, proj = name.split(".")[1], name.rsplit(".", 1)[1]
        assert torch.equal(g, ref[proj_name(int(layer), INPUT_OF[proj])]), name


def test_grams_of_a_layer_cast_for_its_pass_leave_the_model_as_it_was(tiny_dir):
    """layer_grams(dtype=fp32) over a bf16 model gives the Grams of the model cast to fp32 whole, and every parameter
    keeps its own storage and dtype (nothing copied back: the host never holds a layer twice)."""
    half, _ = load_checkpoint(tiny_dir, dtype=torch.bfloat16)
    cast, _ = load_checkpoint(tiny_dir, dtype=torch.bfloat16)
    cast.float()
    before = {n: (p.data_ptr(), p.dtype) for n, p in half.named_parameters()}
    batches, _ = calibration_batches(half, Tokenizer.load(tiny_dir), CALIB, 1000, 128, 3)
    ours = [g for layer in layer_grams(half, batches, "cpu", progress=False, dtype=torch.float32)
            for g in layer.items()]
    theirs = [g for layer in layer_grams(cast, batches, "cpu", progress=False) for g in layer.items()]
    assert [n for n, _ in ours] == [n for n, _ in theirs] and len(ours) == 7 * 3
    for (name, a), (_, b) in zip(ours, theirs):
        assert torch.equal(a, b), name
    assert {n: (p.data_ptr(), p.dtype) for n, p in half.named_parameters()} == before


def test_streamed_compress_equals_factorizing_the_whole_statistics(tiny_dir, tmp_path):
    """compress_model factorizes each layer as soon as its Grams are in (basis-sharing: when the group's last layer's
    are); the factors are those of `factorized` over the whole statistics."""
    out = compress_model(tiny_dir, tmp_path / "bs", "basis-sharing", 0.6, calib_text=CALIB, calib_tokens=2048,
                         calib_seq_len=128, progress=False)
    streamed, man = load_checkpoint(out, dtype=torch.float32)
    src, _ = load_checkpoint(tiny_dir, dtype=torch.float32)
    stats = calibrate(src, Tokenizer.load(tiny_dir), CALIB, max_tokens=2048, seq_len=128, progress=False)
    dense = {n: lin.dense_weight() for n, lin in src.projections().items()}
    whole, kinds = factorized(src, dense, stats, "basis-sharing", man.ranks, man.groups, progress=False)
    assert man.provenance["whitening"] == kinds
    ours = dict(streamed.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.equal(ours[name], p.to(ours[name].dtype)), name  # both stored at the source's dtype


def test_a_bf16_source_gives_what_its_fp32_cast_gives(tiny_dir, tmp_path):
    """The source stays on the host in its stored dtype and each layer and matrix is cast to fp32 when it is used:
    compress and the PARSE pool give, to the bit, what the same weights saved in fp32 give (a multiplied-out
    factorized source included)."""
    from rankserve.compress.parse import build_pool

    def both(model_dir: Path, name: str) -> tuple[Path, Path]:  # the model saved in bf16, and that cast to fp32
        model, man = load_checkpoint(model_dir)
        half = save_checkpoint(tmp_path / f"{name}-bf16", model, man, tokenizer_dir=tiny_dir, dtype=torch.bfloat16)
        cast, _ = load_checkpoint(half, dtype=torch.float32)
        return half, save_checkpoint(tmp_path / f"{name}-fp32", cast, man, tokenizer_dir=tiny_dir)

    half, full = both(tiny_dir, "dense")
    kw = dict(calib_text=CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)
    pairs = []
    for method in ("svd-llm", "basis-sharing"):
        pairs.append([compress_model(d, tmp_path / f"{method}-{d.name}", method, 0.6, **kw) for d in (half, full)])
    factored = both(pairs[0][0], "factored")  # a factorized source, multiplied out
    pairs.append([compress_model(d, tmp_path / f"re-{d.name}", "svd-llm", 0.5, **kw) for d in factored])
    for a, b in pairs:
        ours, theirs = (dict(load_checkpoint(d)[0].named_parameters()) for d in (a, b))
        assert ours["embed.weight"].dtype == torch.bfloat16 and theirs["embed.weight"].dtype == torch.float32
        for name, p in theirs.items():
            assert torch.equal(ours[name], p.to(torch.bfloat16)), (a.name, name)
    pools = [build_pool(d, "svd-llm", 0.6, CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)[0]
             for d in (half, full)]
    theirs = dict(pools[1].named_parameters())
    for name, p in pools[0].named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, theirs[name]), name


@pytest.mark.parametrize("method", ["svd-llm", "basis-sharing"])
def test_compress_by_the_eigh_route_gives_the_same_model(tiny_dir, tmp_path, method):
    """`svd_route="eigh"` (what "auto" takes on a GPU, bench/svd_probe.py) and the SVD ("auto" on the CPU) give the
    same logits."""
    kw = dict(calib_text=CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)
    a, man = load_checkpoint(compress_model(tiny_dir, tmp_path / "svd", method, 0.6, **kw), dtype=torch.float32)
    b, man_b = load_checkpoint(compress_model(tiny_dir, tmp_path / "eigh", method, 0.6, svd_route="eigh", **kw),
                               dtype=torch.float32)
    assert man.provenance["svd_route"] == "svd" and man_b.provenance["svd_route"] == "eigh"
    x = torch.randint(0, 512, (2, 40))
    assert _rel(b(x), a(x)) < 1e-5  # fp32 storage of the same fp64 products
    with pytest.raises(ValueError, match="unknown SVD route"):
        compress_model(tiny_dir, tmp_path / "bad", method, 0.6, svd_route="qr", **kw)
    assert not (tmp_path / "bad").exists()


# --- the pipeline on a random model ----------------------------------------------------------------
def test_keep_one_is_exact_and_factorized_source_is_multiplied_out(tiny_dir, tmp_path):
    dense, _ = load_checkpoint(tiny_dir)
    x = torch.randint(0, 512, (2, 40))
    out = compress_model(tiny_dir, tmp_path / "k1", "svd-llm", 1.0, calib_text=CALIB, progress=False)
    same, man = load_checkpoint(out)
    assert man.keep == 1.0 and all(r is None for r in man.ranks.values())
    assert torch.equal(same(x), dense(x))
    bs = compress_model(tiny_dir, tmp_path / "bs", "basis-sharing", 0.7, calib_text=CALIB, calib_tokens=2048,
                        calib_seq_len=128, progress=False)
    fact, _ = load_checkpoint(bs)
    again = compress_model(bs, tmp_path / "again", "svd", 1.0, progress=False)
    dense_again, man = load_checkpoint(again)
    assert man.provenance["multiplied_out"] and man.provenance["source_family"] == "basis-sharing"
    for name, lin in dense_again.projections().items():
        assert torch.allclose(lin.weight, fact.projections()[name].dense_weight(), atol=1e-6)


@pytest.mark.parametrize("method", ["svd", "svd-llm", "basis-sharing"])
def test_achieved_keep_recorded(tiny_dir, tmp_path, method):
    out = compress_model(tiny_dir, tmp_path / method, method, 0.6, calib_text=CALIB, calib_tokens=2048,
                         calib_seq_len=128, progress=False)
    model, man = load_checkpoint(out)
    assert man.family == method and abs(man.keep - 0.6) <= 0.02 * 0.6
    assert man.provenance["keep_achieved"] == man.keep and man.provenance["keep_requested"] == 0.6
    assert man.kept_params == sum(p.numel() for n, p in model.named_parameters()
                                  if n.startswith("bases.") or ".attn." in n or ".mlp." in n)
    if method != "svd":
        assert man.provenance["calibration"]["tokens"] == 2048


def test_basis_sharing_one_storage_per_group(tiny_dir, tmp_path):
    out = compress_model(tiny_dir, tmp_path / "bs", "basis-sharing", 0.6, calib_text=CALIB, calib_tokens=2048,
                         calib_seq_len=128, group_size=2, progress=False)
    model, man = load_checkpoint(out)
    # 3 layers -> group [0, 1] shares q, k, v, gate, up; layer 2 is a group of one (private)
    assert sorted(man.groups) == ["gate.0-1", "k.0-1", "q.0-1", "up.0-1", "v.0-1"]
    lins = model.projections()
    for g, members in man.groups.items():
        assert members == [proj_name(0, g.split(".")[0]), proj_name(1, g.split(".")[0])]
        assert lins[members[0]].V is lins[members[1]].V
        assert lins[members[0]].V.data_ptr() == lins[members[1]].V.data_ptr()
    assert lins[proj_name(0, "q")].V.data_ptr() != lins[proj_name(0, "k")].V.data_ptr()  # q and k: different bases
    assert proj_name(0, "o") not in {m for ms in man.groups.values() for m in ms}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {f"bases.{g}.V" for g in man.groups} <= keys
    assert not any(k.endswith(".V") and k.startswith(("layers.0.attn.q", "layers.1.attn.q", "layers.0.mlp.up"))
                   for k in keys)  # members store only U
    assert f"{proj_name(2, 'q')}.V" in keys and f"{proj_name(0, 'o')}.V" in keys  # private projections keep V


def test_bad_inputs_leave_nothing(tiny_dir, tmp_path):
    out = tmp_path / "out" / "model"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.\n")
    cases = [
        (dict(method="svd", keep=0), "keep must be"),
        (dict(method="svd", keep=1.5), "keep must be"),
        (dict(method="svd", keep=-0.2), "keep must be"),
        (dict(method="svd-lm", keep=0.5), "unknown method"),
        (dict(method="svd-llm", keep=0.5), "needs calibration text"),
        (dict(method="svd-llm", keep=0.5, calib_text=empty), "is empty"),
        (dict(method="basis-sharing", keep=0.5, calib_text=blank), "is empty"),
        (dict(method="svd-llm", keep=0.5, calib_text=short), "gives only"),
        (dict(method="svd-llm", keep=0.5, calib_text=tmp_path / "nope.txt"), "does not exist"),
        (dict(method="svd", keep=0.5, model_dir=tmp_path / "no-model"), "not a directory"),
    ]
    for kw, msg in cases:
        kw = {"model_dir": tiny_dir, "out_dir": out, "progress": False, **kw}
        with pytest.raises(ValueError, match=msg):
            compress_model(**kw)
        assert not out.exists()
        assert not (out.parent.exists() and any(out.parent.iterdir())), list(out.parent.iterdir())
    with pytest.raises(CheckpointError, match="already exists"):
        compress_model(tiny_dir, tiny_dir, "svd", 0.5, progress=False)


# --- stories260K -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_stories260k_svd_llm_beats_svd(tmp_path):
    held_out = HELD_OUT.read_text()
    tok = Tokenizer.load(STORIES)
    ppl = {}
    for method in ("svd", "svd-llm", "basis-sharing"):
        out = compress_model(STORIES, tmp_path / method, method, 0.8, calib_text=CALIB, calib_tokens=4096,
                             calib_seq_len=256, progress=False)
        model, man = load_checkpoint(out)
        assert abs(man.keep - 0.8) <= 0.02 * 0.8
        ppl[method] = perplexity(model, tok, held_out, seq_len=256, max_tokens=4096)["perplexity"]
    dense, _ = load_checkpoint(STORIES)
    ppl["dense"] = perplexity(dense, tok, held_out, seq_len=256, max_tokens=4096)["perplexity"]
    print("\nstories260K keep 0.8, WikiText-2 test first 4096 tokens, seq 256:",
          ", ".join(f"{k} {v:.1f}" for k, v in ppl.items()))
    assert ppl["dense"] < ppl["svd-llm"] < ppl["svd"]
    assert ppl["basis-sharing"] < ppl["svd"]
    model, man = load_checkpoint(tmp_path / "basis-sharing")
    assert sorted(man.groups) == sorted(f"{p}.{a}-{a + 1}" for p in ("q", "k", "v", "gate", "up") for a in (0, 2))
