"""bench/parse_topics.py: WikiText articles split at their title lines, cosine k-means finds planted clusters, the
Gram blend is the per-token mix and keeps q/k/v's shared input shared, and the in-memory factors equal
`compress_model`'s checkpoint. Uses the bundled stories260K.
Run alone: python -m pytest -q tests/test_bench_parse_topics.py"""

from pathlib import Path

import pytest
import torch

from rankserve.bench.parse_topics import blend, centroids, factorize, kmeans, split_articles
from rankserve.compress.calibrate import calibrate
from rankserve.compress.factorize import compress_model
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def test_articles_split_at_title_lines_only():
    body = "x " * 300
    text = f" \n = First = \n \n {body}\n = = Section = = \n {body}\n = Second = \n {body}\n = Tiny = \n short\n"
    arts = split_articles(text)
    assert len(arts) == 2  # the section heading stays inside the first article; the short one is dropped
    assert arts[0].startswith(" = First = ") and " = = Section = = " in arts[0]
    assert arts[1].startswith(" = Second = ")


def test_kmeans_finds_planted_clusters():
    g = torch.Generator().manual_seed(0)
    poles = torch.eye(3, 8)
    X = torch.cat([p + 0.05 * torch.randn(20, 8, generator=g) for p in poles])
    X = X / X.norm(dim=1, keepdim=True)
    cent, assign = kmeans(X, 3, seed=2)
    truth = torch.arange(3).repeat_interleave(20)
    for j in range(3):  # every planted group lands in one cluster, and distinct groups in distinct ones
        assert len(set(assign[truth == j].tolist())) == 1
    assert len(set(assign.tolist())) == 3
    assert torch.allclose(cent.norm(dim=1), torch.ones(3))
    assert torch.allclose(centroids(X, assign, 3), cent, atol=1e-5)  # converged: centroids are the cluster means
    with pytest.raises(ValueError, match="k-means"):
        kmeans(X, 61)
    with pytest.raises(ValueError, match=r"clusters \[3\] have no rows"):
        centroids(X, assign, 4)


def test_blend_is_the_per_token_mix_and_keeps_shared_inputs():
    model, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    tok = Tokenizer.load(STORIES)
    a = calibrate(model, tok, CALIB, max_tokens=4096, seq_len=64, progress=False)
    b = calibrate(model, tok, CALIB, max_tokens=2048, seq_len=32, progress=False)
    m = blend(a, b, 0.25)
    n = "layers.0.attn.q"
    assert torch.allclose(m.grams[n], 0.75 * a.grams[n] / a.tokens + 0.25 * b.grams[n] / b.tokens)
    assert m.grams["layers.0.attn.k"] is m.grams[n] and m.grams["layers.0.mlp.up"] is m.grams["layers.0.mlp.gate"]
    assert torch.equal(blend(a, b, 0.0).grams[n], a.grams[n] / a.tokens)
    with pytest.raises(ValueError, match="alpha"):
        blend(a, b, 1.5)


@pytest.mark.parametrize("base", ["svd-llm", "basis-sharing"])
def test_in_memory_factors_equal_the_compressed_checkpoint(base, tmp_path):
    src, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    stats = calibrate(src, Tokenizer.load(STORIES), CALIB, max_tokens=8192, progress=False)
    dense = {n: lin.dense_weight().detach() for n, lin in src.projections().items()}
    mine = factorize(src, dense, stats, base, 0.6)
    out = compress_model(STORIES, tmp_path / "c", base, 0.6, calib_text=CALIB, calib_tokens=8192, progress=False)
    theirs, _ = load_checkpoint(out, "cpu", torch.float32)
    x = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(x)
        assert (mine(x) - ref).abs().max() <= 1e-4 * ref.abs().max()  # both fp32 factors of the same fp64 math
