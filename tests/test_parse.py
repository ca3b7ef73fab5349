"""PARSE: STE gradients, aggregation invariance, masks vs gathered factors, subset validation, engine rank reuse.

Run alone: .venv/bin/python -m pytest tests/test_parse.py -q
Builds small PARSE checkpoints of the bundled stories260K (svd-llm, basis-sharing and plain-SVD pools) once per
module; 6 s on 2 idle cores (about 35 s while other jobs load them).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from rankserve.compress.parse import (RouterData, TrainConfig, aggregate_experts, build_parse_checkpoint,
                                      native_experts, plan_experts, ste_topk, train_routers)
from rankserve.workers.checkpoint import load_checkpoint, read_config
from rankserve.workers.engine import Engine
from rankserve.workers.model import Transformer
from rankserve.workers.parse import apply, clear, load_parse, select, select_batch, validate
from rankserve.workers.sampler import SamplingParams
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"  # calibration and router training; not evaluated on
TRAIN = TrainConfig(windows=48, window=32, prompt_len=16, batch_size=16, collect_batch=16, eval_every=2,
                    save_every=2, kd_batch=4, kd_eval=8)


@pytest.fixture(scope="module", params=["svd-llm", "basis-sharing", "svd"])
def parse_dir(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"parse-{request.param}") / "ckpt"
    return build_parse_checkpoint(STORIES, out, keep=0.6, pool_factor=2.0, calib_text=CALIB, train_text=CALIB,
                                  steps=4, kd_steps=2, base=request.param, train=TRAIN, calib_tokens=2048,
                                  calib_seq_len=128, progress=False)


@pytest.fixture(scope="module")
def svd_llm_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parse-svd-llm-engine") / "ckpt"
    return build_parse_checkpoint(STORIES, out, keep=0.6, calib_text=CALIB, train_text=CALIB, steps=2, kd_steps=0,
                                  train=TRAIN, calib_tokens=2048, calib_seq_len=128, progress=False)


def _load64(path: Path):
    model, man = load_checkpoint(path, "cpu", torch.float64)  # fp64: comparisons exact up to summation order
    return model, man, load_parse(path, model)


def _random_subset(routers, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"v": 1, "k": {n: sorted(torch.randperm(routers.r_max[n], generator=g)[:k].tolist())
                          for n, k in routers.k.items()}}


def _gathered(model: Transformer, subset: dict) -> Transformer:
    """The static model holding only the subset's components: U[:, S], V[S, :] per projection (no sharing)."""
    lins = model.projections()
    ranks = {n: (len(subset["k"][n]) if n in subset["k"] else lins[n].rank) for n in lins}
    out = Transformer(model.cfg, ranks, dtype=torch.float64)
    sd = model.state_dict()
    with torch.no_grad():
        for name, p in out.named_parameters():
            proj = name.rsplit(".", 1)[0]
            if proj in subset["k"] and name.endswith((".U", ".V")):
                idx = torch.tensor(subset["k"][proj])
                src = lins[proj].U[:, idx] if name.endswith(".U") else lins[proj].V[idx]
                p.copy_(src)
            else:
                p.copy_(sd[name])
    return out.eval()


# --- training pieces ---------------------------------------------------------------------------------
def test_ste_forward_is_hard_topk_and_gradient_reaches_the_router():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 20, generator=g)
    R = torch.nn.Parameter(torch.randn(12, 20, generator=g) * 0.1)
    b = torch.nn.Parameter(torch.randn(12, generator=g))
    a = torch.randn(6, 12, generator=g)  # per-component loss coefficients
    m = ste_topk(x @ R.T + b, 5)
    assert torch.equal(m.detach().sum(-1), torch.full((6,), 5.0)) and set(m.detach().unique().tolist()) == {0.0, 1.0}
    assert torch.equal(m.detach(), torch.zeros(6, 12).scatter_(-1, (x @ R.T + b).topk(5).indices, 1.0))
    (a * m).sum().backward()
    assert R.grad is not None and b.grad is not None
    assert torch.isfinite(R.grad).all() and R.grad.abs().sum() > 0 and b.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_from", [0, 5])
def test_multilinear_loss_equals_reconstruction_error_on_hard_masks(loss_from):
    """RouterData.loss from the collected statistics == ‖U(m⊙Vx) − Wx‖² / ‖Wx‖² computed directly, over every
    position of the window or from `loss_from` on (loss_scope "continuation")."""
    from rankserve.compress.parse import collect

    g = torch.Generator().manual_seed(1)
    model, _ = load_checkpoint(STORIES, "cpu", torch.float64)
    cfg = model.cfg
    ranks = {n: 10 for n in model.projections()}
    pool = Transformer(cfg, ranks, dtype=torch.float64)
    dense = {n: l.weight.detach() for n, l in model.projections().items()}
    with torch.no_grad():
        for name, p in pool.named_parameters():
            p.copy_(model.state_dict()[name] if name in model.state_dict() else torch.randn(p.shape, generator=g,
                                                                                             dtype=p.dtype) * 0.2)
    windows = torch.randint(0, 512, (3, 12), generator=g)
    data = collect(pool, dense, windows, prompt_len=6, sample_tokens=12, progress=False,  # all tokens sampled: exact
                   loss_from=loss_from)
    name = "layers.1.mlp.up"
    xs = {}
    h = pool.projections()[name].register_forward_pre_hook(lambda mod, inp: xs.setdefault("x", inp[0]))
    with torch.no_grad():
        pool(windows)
    h.remove()
    lin, x = pool.projections()[name], xs["x"][:, loss_from:]  # x (3, 12 - loss_from, in)
    m = (torch.rand(3, 10, generator=g) > 0.5).double()
    y = x @ dense[name].T
    direct = (((x @ lin.V.T) * m[:, None]) @ lin.U.T - y).pow(2).sum((1, 2)) / y.pow(2).sum((1, 2))
    assert name in data.zs  # random U: not orthogonal, the cross term is in play
    assert torch.allclose(data.loss(name, torch.arange(3), m.float()).double(), direct, rtol=1e-4)


def _interrupt_after_first_save(monkeypatch):
    """Make the next train-state write the last thing a run does (as if it were killed right after it)."""
    import rankserve.compress.parse as parse_mod

    real = parse_mod._save_state

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(parse_mod, "_save_state", save_then_die)


def test_train_routers_resumes_to_the_same_result(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(2)
    P, r, d = 40, 8, 6
    data = RouterData(windows=torch.zeros(P, 4, dtype=torch.long),
                      x={"layers.0.attn.q": torch.randn(P, d, generator=g)},
                      a={"layers.0.attn.q": -torch.rand(P, r, generator=g)}, Y={"layers.0.attn.q": torch.ones(P) * 3},
                      zs={}, G_off={}, scale=1.0)
    k = {"layers.0.attn.q": 3}
    cfg = TrainConfig(batch_size=8, save_every=3, eval_every=2, warmup=2)
    R_full, b_full, rep_full = train_routers(data, k, 6, cfg, tmp_path / "a.safetensors", progress=False)
    with monkeypatch.context() as m:
        _interrupt_after_first_save(m)
        with pytest.raises(KeyboardInterrupt):  # killed right after its step-3 state write ...
            train_routers(data, k, 6, cfg, tmp_path / "b.safetensors", progress=False)
    R_res, b_res, rep = train_routers(data, k, 6, cfg, tmp_path / "b.safetensors", progress=False)  # ... resumed
    assert torch.allclose(R_full["layers.0.attn.q"], R_res["layers.0.attn.q"], atol=1e-6)
    assert torch.allclose(b_full["layers.0.attn.q"], b_res["layers.0.attn.q"], atol=1e-6)
    assert rep["steps"] == 6
    # a finished run keeps its result only (no AdamW moments), and a rerun reads it without training again
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata()["done"] == "6" and not any(key.startswith(("opt.", "param.")) for key in f.keys())
    with monkeypatch.context() as m:
        m.setattr("rankserve.compress.parse._ridge", lambda *a, **kw: pytest.fail("trained again"))
        R_again, b_again, rep_again = train_routers(data, k, 6, cfg, tmp_path / "a.safetensors", progress=False)
    assert torch.equal(R_again["layers.0.attn.q"], R_full["layers.0.attn.q"]) and rep_again == rep_full
    # finished at another step count: done again from the start, to the uninterrupted result
    R_8, _, _ = train_routers(data, k, 8, cfg, tmp_path / "c.safetensors", progress=False)
    R_8b, _, _ = train_routers(data, k, 8, cfg, tmp_path / "a.safetensors", progress=False)
    assert torch.allclose(R_8["layers.0.attn.q"], R_8b["layers.0.attn.q"], atol=1e-6)


def _three_matrix_data(seed: int = 3) -> tuple[RouterData, dict[str, int]]:
    g = torch.Generator().manual_seed(seed)
    P, r, d = 48, 10, 6
    names = ["layers.0.attn.q", "layers.0.attn.k", "layers.0.mlp.down"]
    x = {"layers.0.attn.q": torch.randn(P, d, generator=g), "layers.0.mlp.down": torch.randn(P, d + 2, generator=g)}
    data = RouterData(windows=torch.zeros(P, 4, dtype=torch.long), x=x,
                      a={n: -torch.rand(P, r, generator=g) * (1 + torch.arange(r).flip(0) / r) for n in names},
                      Y={n: torch.full((P,), 12.0) for n in names}, zs={}, G_off={}, scale=1.0)
    return data, {"layers.0.attn.q": 4, "layers.0.attn.k": 3, "layers.0.mlp.down": 5}


def test_routers_trained_in_chunks_equal_the_joint_run(tmp_path, monkeypatch):
    """router_chunk trains the matrices a chunk at a time: every matrix's loss is its own, so the routers are the
    joint run's (up to AdamW's eps, which sees the mean's other scale), and an interrupted chunked run resumes from
    its per-chunk state files to the same result."""
    data, k = _three_matrix_data()
    knobs = dict(batch_size=8, save_every=3, eval_every=2, warmup=2, lr=3e-2, holdout=0.25)
    joint, chunked = TrainConfig(**knobs), TrainConfig(**knobs, router_chunk=2)
    R0, b0, rep0 = train_routers(data, k, 20, joint, progress=False)
    R1, b1, rep1 = train_routers(data, k, 20, chunked, tmp_path / "s.safetensors", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.0.safetensors", "s.1.safetensors"]
    for n in k:
        assert torch.allclose(R0[n], R1[n], rtol=1e-3, atol=1e-5) and torch.allclose(b0[n], b1[n], rtol=1e-3, atol=1e-5)
        src = "layers.0.attn.q" if n != "layers.0.mlp.down" else n
        picks = lambda R, b: (data.x[src] @ R.T + b).topk(k[n], -1).indices.sort(-1).values  # noqa: E731
        assert torch.equal(picks(R0[n], b0[n]), picks(R1[n], b1[n]))
    assert rep0["heldout_rel_error"] == pytest.approx(rep1["heldout_rel_error"], rel=1e-4)
    assert rep0["kept"] == rep1["kept"] and rep0["kept"]["ste"] == 2  # the STE iterates are compared too
    (tmp_path / "s.0.safetensors").unlink()
    (tmp_path / "s.1.safetensors").unlink()
    first = train_routers(data, k, 20, chunked, tmp_path / "t.safetensors", progress=False)  # chunk 0 done ...
    (tmp_path / "t.1.safetensors").unlink()
    with monkeypatch.context() as m:
        _interrupt_after_first_save(m)
        with pytest.raises(KeyboardInterrupt):  # ... chunk 1 killed after its step-3 state write
            train_routers(data, k, 20, chunked, tmp_path / "t.safetensors", progress=False)
    R2, b2, _ = train_routers(data, k, 20, chunked, tmp_path / "t.safetensors", progress=False)  # ... resumed
    assert all(torch.equal(first[0][n], R2[n]) for n in k)
    # chunked otherwise over the same state files: a result for other matrices is not taken for this chunk's
    R3, _, _ = train_routers(data, k, 20, TrainConfig(**knobs, router_chunk=1), tmp_path / "t.safetensors",
                             progress=False)
    assert all(torch.allclose(R0[n], R3[n], rtol=1e-3, atol=1e-5) for n in k)
    for n in k:
        assert torch.allclose(R1[n], R2[n], atol=1e-6) and torch.allclose(b1[n], b2[n], atol=1e-6)


@pytest.mark.parametrize("n, d", [(30, 8), (8, 30)])  # more windows than inputs (primal), fewer (the kernel form)
def test_ridge_warm_start_solves_the_ridge_problem(n, d):
    from rankserve.compress.parse import _ridge

    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = (x - x.mean(0)).float()
    a, Y = -torch.rand(n, 4, generator=g), torch.full((n,), 2.0)
    R, b = _ridge(x, a, Y, torch.arange(n), (0.3,), lambda R, b: 0.0)
    X, G = x.double(), (-a / 2.0).double()
    W = torch.linalg.solve(X.T @ X + 0.3 * n * torch.eye(d, dtype=torch.float64), X.T @ (G - G.mean(0)))
    scale = (X @ W + G.mean(0)).std()
    assert torch.allclose(R.double(), W.T / scale, rtol=1e-5, atol=1e-6)
    assert torch.allclose(b.double(), G.mean(0) / scale, rtol=1e-5)


def test_router_chunk_is_checked():
    with pytest.raises(ValueError, match="router_chunk"):
        TrainConfig(router_chunk=-1)


@pytest.mark.parametrize("bad, match", [(dict(loss_scope="prompt"), "loss_scope"), (dict(kd_loss="mse"), "kd_loss"),
                                        (dict(kd_guard="kl"), "kd_guard"),
                                        (dict(loss_scope="continuation", prompt_len=32, window=32), "continuation")])
def test_kd_knobs_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**bad)


def test_kd_loss_scores_the_positions_and_target_it_names():
    """The end-to-end stage's held-out loss at its start (0 steps: the routers it was given) is, for each loss_scope and
    kd_loss, the KL to the dense model or the cross-entropy to its argmax token, over every position of the window or
    from the one predicting the first token after the prompt; computed here from the routers' hard masks directly."""
    from dataclasses import replace

    from rankserve.compress.parse import build_pool, collect, distill_routers, sample_windows
    from rankserve.workers.parse import router_input

    cfg = TrainConfig(windows=24, window=32, prompt_len=16, collect_batch=8, kd_eval=8, holdout=0.34)
    model, k, _ = build_pool(STORIES, "svd-llm", 0.6, CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)
    dense, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    wins = sample_windows(CALIB, Tokenizer.load(STORIES), cfg.windows, cfg.window)
    data = collect(model, {n: l.dense_weight().detach() for n, l in dense.projections().items()}, wins,
                   cfg.prompt_len, batch_size=8, progress=False)
    R, b, _ = train_routers(data, k, 0, cfg, progress=False)
    lins = model.projections()
    with torch.no_grad():
        for n in k:  # the last 8 windows are held out, all of them scored (kd_eval = 8)
            s = data.x[router_input(n)][-8:] @ R[n].T + b[n]
            lins[n].mask = torch.zeros_like(s).scatter_(-1, s.topk(k[n], dim=-1).indices, 1.0)
        x = data.windows[-8:]
        lp, ref = torch.log_softmax(model(x), -1), torch.log_softmax(dense(x), -1)  # (8, 32, V)
        for n in k:
            lins[n].mask = None
    per_pos = {"kl": (ref.exp() * (ref - lp)).sum(-1), "argmax": -lp.gather(-1, ref.argmax(-1, keepdim=True))[..., 0]}
    agree = (lp.argmax(-1) == ref.argmax(-1)).float()  # (8, 32)
    got = {}
    for scope, first in (("window", 0), ("continuation", cfg.prompt_len - 1)):
        for loss in ("kl", "argmax"):
            _, _, rep = distill_routers(model, dense, data, k, R, b, 0, replace(cfg, loss_scope=scope, kd_loss=loss),
                                        progress=False)
            got[scope, loss] = rep["kd_heldout_kl_start"]
            assert got[scope, loss] == pytest.approx(float(per_pos[loss][:, first:].mean()), rel=1e-5)
            assert rep["kd_heldout_top1_start"] == pytest.approx(float(agree[:, first:].mean()), abs=1e-6)
    assert got["window", "kl"] != pytest.approx(got["continuation", "kl"], rel=1e-3)


def _kd_setup(cfg: TrainConfig):
    """A stories260K pool, its dense model, router data and layer-local routers (0 steps: the warm start)."""
    from rankserve.compress.parse import build_pool, collect, sample_windows

    model, k, r_max = build_pool(STORIES, "svd-llm", 0.6, CALIB, calib_tokens=2048, calib_seq_len=128,
                                 progress=False)
    dense, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    wins = sample_windows(CALIB, Tokenizer.load(STORIES), cfg.windows, cfg.window)
    data = collect(model, {n: l.dense_weight().detach() for n, l in dense.projections().items()}, wins,
                   cfg.prompt_len, batch_size=8, progress=False)
    R, b, _ = train_routers(data, k, 0, cfg, progress=False)
    return model, dense, data, k, r_max, R, b


def test_kd_stage_resumes_and_keeps_only_its_result(tmp_path, monkeypatch):
    """The end-to-end stage killed after a state write resumes to the uninterrupted result; a finished stage keeps
    its best routers only (no AdamW moments), and a rerun reads them without a step."""
    from safetensors import safe_open

    from rankserve.compress.parse import distill_routers

    # scored on training windows (holdout 0), so that the steps show: held out, this model keeps its start
    cfg = TrainConfig(windows=24, window=32, prompt_len=16, collect_batch=8, kd_eval=8, holdout=0.0, kd_batch=4,
                      eval_every=1, save_every=2, warmup=1, kd_lr=1e-3)
    model, dense, data, k, _, R, b = _kd_setup(cfg)
    R1, b1, rep1 = distill_routers(model, dense, data, k, R, b, 4, cfg, tmp_path / "a.safetensors", progress=False)
    assert rep1["kd_kept"] != "start"  # the steps moved the routers (else the resume below would prove little)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata()["done"] == "4" and not any(key.startswith(("opt.", "param.")) for key in f.keys())
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", lambda *a, **kw: pytest.fail("stepped again"))
        R2, b2, rep2 = distill_routers(model, dense, data, k, R, b, 4, cfg, tmp_path / "a.safetensors",
                                       progress=False)
    # b to rounding: b = b̂ − R μ, and the kept R comes back contiguous where the run's own was a transposed view
    assert rep2 == rep1 and all(torch.equal(R1[n], R2[n]) and torch.allclose(b1[n], b2[n], atol=1e-6) for n in k)
    with monkeypatch.context() as m:
        _interrupt_after_first_save(m)
        with pytest.raises(KeyboardInterrupt):  # killed right after its step-2 state write ...
            distill_routers(model, dense, data, k, R, b, 4, cfg, tmp_path / "b.safetensors", progress=False)
    R3, b3, rep3 = distill_routers(model, dense, data, k, R, b, 4, cfg, tmp_path / "b.safetensors", progress=False)
    assert rep3["kd_heldout_kl"] == pytest.approx(rep1["kd_heldout_kl"], rel=1e-5)  # ... resumed
    assert rep3["kd_heldout_top1_start"] == rep1["kd_heldout_top1_start"]  # the guard's reference survives it
    assert all(torch.allclose(R1[n], R3[n], atol=1e-5) and torch.allclose(b1[n], b3[n], atol=1e-5) for n in k)


@pytest.mark.parametrize("loss, top1, guard, accepted", [
    (0.9, 0.30, "top1", True),    # lower loss, agreement kept
    (0.9, 0.29, "top1", False),   # lower loss bought with agreement: refused
    (0.9, 0.29, "none", True),    # unguarded: the loss alone
    (1.1, 0.40, "top1", False),   # agreement up, loss not lower
])
def test_kd_guard_refuses_an_iterate_that_buys_loss_with_agreement(loss, top1, guard, accepted):
    from rankserve.compress.parse import _kd_accepts

    assert _kd_accepts(loss, top1, best_loss=1.0, start_top1=0.30, guard=guard) is accepted
    assert _kd_accepts(0.9, 0.0, best_loss=1.0, start_top1=None, guard="top1")  # a pre-guard state: loss decides


def test_kd_stage_asks_the_guard_with_the_starts_agreement(monkeypatch):
    """Every held-out evaluation goes through `_kd_accepts` with the start's agreement and the configured guard;
    when it refuses every iterate the stage keeps its start."""
    from rankserve.compress import parse

    cfg = TrainConfig(windows=24, window=32, prompt_len=16, collect_batch=8, kd_eval=8, holdout=0.0, kd_batch=4,
                      eval_every=1, warmup=1, kd_lr=1e-3)
    model, dense, data, k, _, R, b = _kd_setup(cfg)
    calls = []
    real = parse._kd_accepts
    monkeypatch.setattr(parse, "_kd_accepts", lambda *a: calls.append(a) or real(*a))
    _, _, rep = parse.distill_routers(model, dense, data, k, R, b, 3, cfg, progress=False)
    assert len(calls) == 3 and all(c[3] == rep["kd_heldout_top1_start"] and c[4] == "top1" for c in calls)
    assert rep["kd_kept"] != "start" and rep["kd_heldout_top1"] >= rep["kd_heldout_top1_start"]
    monkeypatch.setattr(parse, "_kd_accepts", lambda *a: False)
    _, _, rep = parse.distill_routers(model, dense, data, k, R, b, 3, cfg, progress=False)
    assert rep["kd_kept"] == "start" and rep["kd_heldout_top1"] == rep["kd_heldout_top1_start"]
    assert rep["kd_heldout_kl"] == pytest.approx(rep["kd_heldout_kl_start"], rel=1e-6)


def test_a_kd_stage_that_cannot_fit_its_device_is_refused_before_any_work(tmp_path, monkeypatch):
    """kd_stage_bytes counts the pool and dense model (fp32) and every router parameter four times (value, gradient,
    two AdamW moments), or offloaded the pool, the dense model less all but one layer, and every router parameter
    twice; "auto" offloads only when the plain stage cannot fit, and build_parse_checkpoint refuses a CUDA device
    too small for either before it writes anything (the device's size is mocked: this machine has no GPU)."""
    from types import SimpleNamespace

    from rankserve.compress.parse import kd_placement, kd_stage_bytes

    cfg = TrainConfig(windows=24, window=32, prompt_len=16, collect_batch=8)
    model, dense, _, k, r_max, R, b = _kd_setup(cfg)
    routers = sum(R[n].numel() + b[n].numel() for n in k)
    held = 4 * sum(p.numel() for m in (model, dense) for p in m.parameters()) + 16 * routers
    layers = sum(p.numel() for p in dense.layers[1:].parameters())
    held_offload = held - 4 * layers - 8 * routers
    assert kd_stage_bytes(model.cfg, r_max, model.groups) == held
    assert kd_stage_bytes(model.cfg, r_max, model.groups, offload=True) == held_offload < held

    def memory(total: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))

    def place(offload: str) -> bool:
        return kd_placement(model.cfg, r_max, model.groups, "cuda", offload)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    memory(held)  # exactly enough for the plain stage
    assert (place("auto"), place("off"), place("on")) == (False, False, True)
    memory(held - 1)
    assert place("auto") and place("on")
    with pytest.raises(ValueError, match=r"holds at least .* pass --kd-steps 0 .* --kd-offload on"):
        place("off")
    assert not kd_placement(model.cfg, r_max, model.groups, "cpu", "auto")  # not a CUDA device: nothing to check
    assert kd_placement(model.cfg, r_max, model.groups, "cpu", "on")
    memory(held_offload)
    assert place("auto")
    memory(held_offload - 1)
    with pytest.raises(ValueError, match="kd offload must be one of auto, on, off"):
        place("yes")
    with pytest.raises(ValueError, match=r"\(KD\) stage holds at least .* one dense layer .* pass --kd-steps 0"):
        build_parse_checkpoint(STORIES, tmp_path / "out", keep=0.6, calib_text=CALIB, train_text=CALIB, steps=1,
                               kd_steps=1, train=cfg, calib_tokens=2048, progress=False, device="cuda")
    assert not any(tmp_path.iterdir())  # refused before the work dir: nothing written


def test_the_offloaded_kd_stage_gives_the_plain_result_to_the_bit(tmp_path, monkeypatch):
    """The dense teacher streamed a layer at a time (host_teacher) and AdamW stepped a parameter at a time with its
    moments on the host (host_step) give the plain stage's routers and report exactly, interrupted and resumed too;
    the teacher's layers hold their host tensors again after every forward."""
    from rankserve.compress.offload import host_teacher
    from rankserve.compress.parse import distill_routers

    cfg = TrainConfig(windows=24, window=32, prompt_len=16, collect_batch=8, kd_eval=8, holdout=0.0, kd_batch=4,
                      eval_every=1, save_every=2, warmup=1, kd_lr=1e-3)
    model, dense, data, k, _, R, b = _kd_setup(cfg)
    R1, b1, rep1 = distill_routers(model, dense, data, k, R, b, 4, cfg, tmp_path / "a.safetensors", progress=False)
    assert rep1["kd_kept"] != "start"
    teacher = host_teacher(load_checkpoint(STORIES, "cpu", torch.float32)[0], "cpu")
    ptrs = [p.data_ptr() for p in teacher.layers.parameters()]
    x = data.windows[:2]
    assert torch.equal(teacher(x), dense(x))
    assert [p.data_ptr() for p in teacher.layers.parameters()] == ptrs
    # weights stored in bf16 wait in bf16 and are cast for each forward: the fp32 cast model's logits, exactly
    cast = load_checkpoint(STORIES, "cpu", torch.bfloat16)[0]
    half = host_teacher(load_checkpoint(STORIES, "cpu", torch.bfloat16)[0], "cpu", torch.float32)
    assert torch.equal(half(x), cast.float()(x))
    assert {p.dtype for p in half.layers.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16, torch.float32}  # embedding, norm, head cast
    with monkeypatch.context() as m:
        _interrupt_after_first_save(m)
        with pytest.raises(KeyboardInterrupt):
            distill_routers(model, teacher, data, k, R, b, 4, cfg, tmp_path / "b.safetensors", progress=False,
                            host="cpu")
    R2, b2, rep2 = distill_routers(model, teacher, data, k, R, b, 4, cfg, tmp_path / "b.safetensors",
                                   progress=False, host="cpu")
    R3, b3, rep3 = distill_routers(model, teacher, data, k, R, b, 4, cfg, None, progress=False, host="cpu")
    assert rep3 == rep1 and rep2["kd_heldout_kl"] == pytest.approx(rep1["kd_heldout_kl"], rel=1e-5)
    assert all(torch.equal(R1[n], R3[n]) and torch.equal(b1[n], b3[n]) for n in k)
    # resumed: as close as the plain stage's own resume (the test above)
    assert all(torch.allclose(R1[n], R2[n], atol=1e-5) and torch.allclose(b1[n], b2[n], atol=1e-5) for n in k)


def test_router_data_moves_whole():
    """RouterData.to (training runs on the data's device, `train-parse --device`) moves every tensor it holds."""
    g = torch.Generator().manual_seed(3)
    n = "layers.0.attn.q"
    data = RouterData(windows=torch.zeros(5, 4, dtype=torch.long), x={n: torch.randn(5, 6, generator=g)},
                      a={n: torch.randn(5, 8, generator=g)}, Y={n: torch.ones(5)}, zs={n: torch.randn(5, 2, 8)},
                      G_off={n: torch.randn(8, 8, generator=g)}, scale=2.0)
    moved = data.to("meta")  # a device with no data: only placement is checked
    fields = [moved.windows, *moved.x.values(), *moved.a.values(), *moved.Y.values(), *moved.zs.values(),
              *moved.G_off.values()]
    assert len(fields) == 6 and all(t.device.type == "meta" for t in fields) and moved.scale == 2.0
    assert data.windows.device.type == "cpu"  # the original stays


# --- the checkpoint ----------------------------------------------------------------------------------
def test_checkpoint_records_parse_state(parse_dir):
    man = json.loads((parse_dir / "rankserve.json").read_text())
    state = man["methods"]["parse"]
    model, _, routers = _load64(parse_dir)
    base = state["base"]
    k, r_max, _ = plan_experts(model.cfg, base, 0.6, 2.0)
    assert state["k"] == k and state["r_max"] == r_max and man["family"] == f"parse-{base}"
    assert all(man["ranks"][n] == r for n, r in r_max.items())
    assert all(0 <= state["head"][n] <= r_max[n] for n in k)
    for key in ("router_granularity", "router_input", "k", "loss", "ste", "retrieval_embedding", "groups"):
        assert key in state["choices"]
    assert state["keep_compute"] < man["keep"]  # memory at r_max exceeds compute at K
    assert set(routers.k) == set(k)
    if base == "basis-sharing":
        assert man["groups"] and all(model.projections()[ms[0]].V is model.projections()[ms[1]].V
                                     for ms in man["groups"].values())


def test_static_subset_is_the_static_checkpoint(parse_dir, tmp_path):
    """The pool is the base compressor's own factorization at r_max: its first K components (static_subset, wherever
    aggregation moved them) give the logits of the static checkpoint `rankserve compress` writes at the same keep."""
    from rankserve.compress.factorize import compress_model
    model, man, routers = _load64(parse_dir)
    base = man.methods["parse"]["base"]
    static_dir = compress_model(STORIES, tmp_path / "static", base, 0.6, calib_text=CALIB, calib_tokens=2048,
                                calib_seq_len=128, progress=False)
    static, _ = load_checkpoint(static_dir, "cpu", torch.float64)
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))
    apply(model, [routers.static_subset()] * 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), static(x), rtol=1e-5, atol=1e-5)
    clear(model)


@pytest.mark.parametrize("method", ["svd-llm", "basis-sharing"])
def test_a_low_rank_checkpoint_is_a_pool_of_its_own_components(method, tmp_path):
    """train-parse --pool: a checkpoint compressed at keep 0.8 is the pool of a keep-0.6 PARSE model, r_max = its
    ranks; its first K components per matrix (static_subset) give the logits of the same method at keep 0.6 with
    the same calibration (one whitened SVD, truncated further); the routers pick K of them per prompt."""
    from rankserve.compress.factorize import compress_model
    kw = dict(calib_text=CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)
    pool_dir = compress_model(STORIES, tmp_path / "pool", method, 0.8, **kw)
    static_dir = compress_model(STORIES, tmp_path / "static", method, 0.6, **kw)
    out = build_parse_checkpoint(STORIES, tmp_path / "parse", keep=0.6, train_text=CALIB, steps=2, kd_steps=2,
                                 train=TRAIN, progress=False, pool_from=pool_dir)
    model, man, routers = _load64(out)
    pool, pool_man = load_checkpoint(pool_dir, "cpu", torch.float64)
    state = man.methods["parse"]
    assert state["base"] == method and man.family == f"parse-{method}" and state["pool_from"] == str(pool_dir)
    assert state["pool_factor"] is None and state["calibration"] is None
    assert routers.r_max == {n: l.rank for n, l in pool.projections().items() if l.factorized}
    assert all(routers.k[n] < routers.r_max[n] for n in routers.k) and man.groups == pool_man.groups
    static, _ = load_checkpoint(static_dir, "cpu", torch.float64)
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        apply(model, [routers.static_subset()] * 2)
        torch.testing.assert_close(model(x), static(x), rtol=1e-5, atol=1e-5)
        clear(model)
        torch.testing.assert_close(model(x), pool(x), rtol=1e-5, atol=1e-5)  # every component: the pool itself
    tok = Tokenizer.load(STORIES)
    sub = select(model, routers, tok.encode("Once upon a time"))
    assert validate(sub, routers) and all(len(v) == routers.k[n] for n, v in sub["k"].items())


def test_a_pool_without_room_or_of_another_model_is_refused(tmp_path):
    from rankserve.compress.factorize import compress_model
    small = compress_model(STORIES, tmp_path / "small", "svd-llm", 0.5, calib_text=CALIB, calib_tokens=2048,
                           calib_seq_len=128, progress=False)
    build = lambda pool, out: build_parse_checkpoint(STORIES, tmp_path / out, keep=0.6, train_text=CALIB,  # noqa
                                                     steps=1, kd_steps=0, train=TRAIN, progress=False, pool_from=pool)
    with pytest.raises(ValueError, match="a pool needs more components than K"):
        build(small, "a")
    with pytest.raises(ValueError, match="no factorized projection"):
        build(STORIES, "b")
    with pytest.raises(ValueError, match="is not a version of"):
        build(ROOT / "models" / "reference", "c")
    with pytest.raises(ValueError, match="needs calib_text"):
        build_parse_checkpoint(STORIES, tmp_path / "d", keep=0.6, train_text=CALIB, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]


def test_dense_and_pool_must_be_what_they_claim(svd_llm_dir, tmp_path):
    """DENSE must be dense (the routers learn its outputs); a pool must be a plain low-rank checkpoint of that very
    model: not a PARSE one (re-ordered components), not another model of the same shape. Refused before any write."""
    from safetensors.torch import load_file, save_file

    from rankserve.compress.factorize import compress_model
    pool = compress_model(STORIES, tmp_path / "pool", "svd-llm", 0.8, calib_text=CALIB, calib_tokens=2048,
                          calib_seq_len=128, progress=False)
    other = tmp_path / "other"  # the same checkpoint with another model's embeddings
    shutil.copytree(pool, other)
    w = load_file(other / "model.safetensors")
    w["embed.weight"] = torch.randn_like(w["embed.weight"].float()).to(w["embed.weight"].dtype)
    save_file(w, other / "model.safetensors")
    build = lambda dense, out, **kw: build_parse_checkpoint(dense, tmp_path / out, keep=0.6, train_text=CALIB,  # noqa
                                                            steps=1, kd_steps=0, train=TRAIN, progress=False, **kw)
    with pytest.raises(ValueError, match=r"is a low-rank \(svd-llm\) checkpoint, not a dense one"):
        build(pool, "a", calib_text=CALIB)
    with pytest.raises(ValueError, match="is a PARSE checkpoint, not a dense one"):
        build(svd_llm_dir, "b", pool_from=pool)
    with pytest.raises(ValueError, match="carries parse state; pass the low-rank checkpoint it was built from"):
        build(STORIES, "c", pool_from=svd_llm_dir)
    with pytest.raises(ValueError, match="its embed.weight differs"):
        build(STORIES, "d", pool_from=other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "pool"]


def test_a_basis_sharing_pool_with_a_smaller_last_group_is_accepted(tmp_path):
    """group_size 3 over the bundled model's 5 layers: groups of 3 and 2, as basis-sharing plans them."""
    from rankserve.compress.factorize import compress_model
    pool = compress_model(STORIES, tmp_path / "pool", "basis-sharing", 0.8, calib_text=CALIB, calib_tokens=2048,
                          calib_seq_len=128, group_size=3, progress=False)
    cfg, man = read_config(pool)
    assert sorted({len(ms) for ms in man.groups.values()}) == [2, 3]
    k, r_max = native_experts(cfg, man.ranks, man.groups, 0.6)
    assert k and all(k[n] < r_max[n] for n in k)


def test_a_resumed_run_must_match_its_inputs(tmp_path):
    """The work dir knows its inputs by content, not path, and every knob that shapes the routers: other --steps,
    or a pool rebuilt at the same path, is refused (WorkDirMismatch) rather than mixed in. resume=False discards a
    work dir only once the inputs are checked."""
    from rankserve.compress.factorize import compress_model
    from rankserve.compress.parse import WorkDirMismatch
    kw = dict(calib_text=CALIB, calib_tokens=2048, calib_seq_len=128, progress=False)
    pool = compress_model(STORIES, tmp_path / "pool", "svd-llm", 0.8, **kw)
    work = tmp_path / "work"
    build = lambda out, steps=1, pool_from=pool, **kw: build_parse_checkpoint(  # noqa: E731
        STORIES, tmp_path / out, keep=0.6, train_text=CALIB, steps=steps, kd_steps=0, train=TRAIN, progress=False,
        pool_from=pool_from, work_dir=work, keep_work=True, **kw)
    build("a")
    with pytest.raises(WorkDirMismatch):
        build("b", steps=2)
    shutil.rmtree(pool)
    compress_model(STORIES, pool, "svd-llm", 0.9, **kw)  # another pool at the same path
    with pytest.raises(WorkDirMismatch):
        build("b")
    with pytest.raises(ValueError, match="is not a directory"):
        build("b", resume=False, pool_from=tmp_path / "nope")
    assert (work / "data.safetensors").is_file()  # bad input: the earlier run's work kept
    build("b", resume=False)
    r_max = [read_config(tmp_path / d)[1].methods["parse"]["r_max"] for d in "ab"]
    assert r_max[0] != r_max[1]  # b's experts are the new pool's


def test_parse_bases_listed_alike():
    from rankserve import cli
    from rankserve.compress.parse import BASES
    assert cli.PARSE_BASES == BASES


def test_permutation_leaves_outputs_unchanged(parse_dir):
    model, _, routers = _load64(parse_dir)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(x)
    subset = _random_subset(routers, 4)
    apply(model, [subset, None])
    with torch.no_grad():
        masked_before = model(x)
    clear(model)
    g = torch.Generator().manual_seed(5)
    freq = {n: torch.rand(r, generator=g) for n, r in routers.r_max.items()}
    R = {n: v.double() for n, v in routers.R.items()}
    b = {n: v.double() for n, v in routers.b.items()}
    probe = {n: torch.randn(R[n].shape[1], dtype=torch.float64, generator=g) for n in R}
    scores = {n: probe[n] @ R[n].T + b[n] for n in R}
    perms, _ = aggregate_experts(model, R, b, freq)
    with torch.no_grad():
        after = model(x)
    assert torch.allclose(after, before, rtol=1e-9, atol=1e-9)
    for n in R:  # router rows moved with their components
        assert torch.allclose(probe[n] @ R[n].T + b[n], scores[n][perms[n]])
    # the same subset, renamed through the permutation, gives the same masked model
    inv = {n: torch.argsort(p) for n, p in perms.items()}
    moved = {"v": 1, "k": {n: sorted(inv[n][torch.tensor(s)].tolist()) for n, s in subset["k"].items()}}
    apply(model, [moved, None])
    with torch.no_grad():
        assert torch.allclose(model(x), masked_before, rtol=1e-9, atol=1e-9)
    clear(model)


def test_subset_of_all_components_equals_full_model(parse_dir):
    model, _, routers = _load64(parse_dir)
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(x)
    everything = {"v": 1, "k": {n: list(range(r)) for n, r in routers.r_max.items()}}
    apply(model, [everything, everything])
    with torch.no_grad():
        assert torch.equal(model(x), full)
    clear(model)


def test_k_subset_masks_equal_gathered_factors(parse_dir):
    model, _, routers = _load64(parse_dir)
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(7))
    s0, s1 = _random_subset(routers, 8), _random_subset(routers, 9)
    apply(model, [s0, s1])  # a different subset per row
    with torch.no_grad():
        masked = model(x)
    clear(model)
    with torch.no_grad():
        assert torch.allclose(masked[0], _gathered(model, s0)(x[:1])[0], rtol=1e-9, atol=1e-9)
        assert torch.allclose(masked[1], _gathered(model, s1)(x[1:])[0], rtol=1e-9, atol=1e-9)
    static = routers.static_subset()  # the base's first K, wherever aggregation moved them
    assert all(len(v) == routers.k[n] for n, v in static["k"].items())


def test_subset_validation(parse_dir):
    model, _, routers = _load64(parse_dir)
    good = _random_subset(routers)
    assert validate(json.loads(json.dumps(good)), routers) == good
    name = next(iter(routers.k))
    bad = [
        ("not a dict", "rank subset is"),
        ({"v": 2, "k": good["k"]}, "rank subset is"),
        ({"v": 1, "k": {**good["k"], "layers.99.attn.q": [0]}}, "does not route"),
        ({"v": 1, "k": {n: v for n, v in good["k"].items() if n != name}}, "lacks projections"),
        ({"v": 1, "k": {**good["k"], name: good["k"][name][:-1]}}, "distinct indices"),
        ({"v": 1, "k": {**good["k"], name: [0] * routers.k[name]}}, "distinct indices"),
        ({"v": 1, "k": {**good["k"], name: list(range(routers.r_max[name] - routers.k[name] + 1,
                                                      routers.r_max[name] + 1))}}, "must be in"),
        ({"v": 1, "k": {**good["k"], name: [-1] + good["k"][name][1:]}}, "must be in"),
        ({"v": 1, "k": {**good["k"], name: [str(i) for i in good["k"][name]]}}, "integer indices"),
        ({"v": 1, "k": {**good["k"], name: [True] + good["k"][name][1:]}}, "integer indices"),
        ({"v": 1, "k": {**good["k"], name: [0.0] + good["k"][name][1:]}}, "integer indices"),
        ({"v": 1, "k": {**good["k"], name: good["k"][name][:-1] + [2 ** 70]}}, "must be in"),
        ({"v": 1, "k": {**good["k"], name: good["k"][name][::-1][:-1] + good["k"][name][-1:]}}, "distinct indices"),
    ]
    for subset, msg in bad:
        with pytest.raises(ValueError, match=msg):
            validate(subset, routers)
    shuffled = {"v": 1, "k": {n: v[::-1] for n, v in good["k"].items()}}  # distinct but unsorted: sorted back
    assert validate(shuffled, routers) == good


def test_select_is_a_valid_subset_and_batch_matches_single(parse_dir):
    model, _, routers = _load64(parse_dir)
    tok = Tokenizer.load(parse_dir)
    a, b = tok.encode("Once upon a time there was a dog", bos=True), tok.encode("The sun", bos=True)
    s = select(model, routers, a)
    assert validate(s, routers) == s
    tokens = torch.zeros(2, len(a), dtype=torch.long)
    tokens[0], tokens[1, :len(b)] = torch.tensor(a), torch.tensor(b)
    batch = select_batch(model, routers, tokens, torch.tensor([len(a), len(b)]))  # right padding ignored
    assert batch[0] == s and batch[1] == select(model, routers, b)


# --- the engine: rank reuse ----------------------------------------------------------------------------
def test_engine_with_subset_equals_gathered_static_model(svd_llm_dir):
    model, man, routers = _load64(svd_llm_dir)
    tok = Tokenizer.load(svd_llm_dir)
    engine = Engine(model, tok, man, routers=routers)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = "Once upon a time"
    subset = engine.rank_subset(prompt)
    assert subset is not None and validate(subset, routers) == subset
    ours = engine.generate(prompt, greedy, subset=subset)
    theirs = Engine(_gathered(model, subset), tok).generate(prompt, greedy)
    assert ours.token_ids == theirs.token_ids
    assert engine.generate(prompt, greedy).token_ids == ours.token_ids  # no subset: the routers choose the same
    other = _random_subset(routers, 11)
    assert engine.generate(prompt, greedy, subset=other).token_ids == \
        Engine(_gathered(model, other), tok).generate(prompt, greedy).token_ids
    with pytest.raises(ValueError, match="distinct indices"):
        engine.generate(prompt, greedy, subset={"v": 1, "k": {n: [0] for n in routers.k}})


def test_rank_reuse_masks_frozen_through_decode(svd_llm_dir):
    engine = Engine.load(svd_llm_dir)
    lin = engine.model.projections()["layers.2.mlp.down"]
    subset = engine.rank_subset("Lily and Ben went to the park")
    seen = []
    h = lin.register_forward_pre_hook(lambda mod, inp: seen.append((inp[0].shape[1], mod.mask.clone())))
    engine.generate("Lily and Ben went to the park", SamplingParams(max_new_tokens=10, ignore_eos=True), subset)
    h.remove()
    assert len(seen) == 10 and seen[0][0] > 1 and all(s == 1 for s, _ in seen[1:])  # prefill + 9 decode steps
    want = torch.zeros(1, lin.rank)
    want[0, subset["k"]["layers.2.mlp.down"]] = 1
    assert all(torch.equal(m, want) for _, m in seen)  # the prefill subset, frozen
    assert all(l.mask is None for l in engine.model.projections().values())  # cleared after the request
    events = list(engine.stream("Lily", SamplingParams(max_new_tokens=3, ignore_eos=True), subset))
    assert len(events) == 3 and lin.mask is None


def test_batch_rows_keep_their_own_subsets(svd_llm_dir):
    """Engine.stream_batch with a different subset per row gives each row the tokens it gets alone."""
    engine = Engine.load(svd_llm_dir)
    prompts = ["Once upon a time", "Lily and Ben went to the park", "The dog"]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    subsets = [engine.rank_subset(p) for p in prompts]
    assert len({json.dumps(s, sort_keys=True) for s in subsets}) == 3
    alone = [engine.generate(p, greedy, s).token_ids for p, s in zip(prompts, subsets)]
    ids: list[list[int]] = [[], [], []]
    for step in engine.stream_batch(prompts, [greedy] * 3, subsets):
        for i, ev in step.items():
            ids[i].append(ev.token_id)
    assert ids == alone
    with pytest.raises(ValueError, match="needs every row's rank subset"):
        engine.stream_batch(prompts[:1], [greedy], [None])


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_rows_with_their_own_subsets_join_a_running_batch(svd_llm_dir, fast_path):
    """Continuous batching on a PARSE model: rows join a running batch with their own subsets (the slots reloaded
    or the masks re-applied, the batch moved to larger buckets), prompts scored and routed between steps leave the
    batch's masks alone, and each row's tokens are what it gets alone with its subset."""
    engine = Engine.load(svd_llm_dir, fast_path=fast_path)
    prompts = ["Once upon a time", "Lily and Ben went to the park", "The dog"]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    subsets = [engine.rank_subset(p) for p in prompts]
    alone = [engine.generate(p, greedy, s).token_ids for p, s in zip(prompts, subsets)]
    stream = engine.stream_batch(prompts[:1], [greedy], subsets[:1])
    got: dict[int, list[int]] = {}
    for step in range(30):
        if step in (2, 5):
            j = 1 if step == 2 else 2
            assert stream.add(prompts[j], greedy, subsets[j]) == j
        if step == 3:  # what the worker does for a joining request between steps
            engine.rank_subset(prompts[2])
            engine.prompt_logprobs(prompts[1], 2, subsets[1])
        try:
            events = next(stream)
        except StopIteration:
            break
        for i, ev in events.items():
            got.setdefault(i, []).append(ev.token_id)
    assert [got[i] for i in range(3)] == alone and stream._batch.moves >= 2
    with pytest.raises(ValueError, match="needs every row's rank subset"):
        stream.add(prompts[0], greedy)


def test_worker_batch_of_hits_and_misses(svd_llm_dir):
    """Concurrent PARSE requests in one worker batch: a miss is routed, a hit keeps its cached subset, and a cached
    subset this model can't take is routed afresh instead of failing the batch (and reported as refused); each text
    is the engine's own."""
    import asyncio

    from rankserve.deployments.worker import Worker

    w = Worker.func_or_class("parse", {"model_dir": str(svd_llm_dir), "torch_threads": 1})
    prompts = ["Once upon a time", "Lily and Ben went to the park", "The dog"]
    hit = w.engine.rank_subset(prompts[0])  # a subset another prompt chose: what a rank-cache hit brings
    sampling = dict(max_new_tokens=10, temperature=0.0, ignore_eos=True)

    real, calls = w.engine.rank_subset, []
    w.engine.rank_subset = lambda p: calls.append(p) or real(p)

    async def go():
        return await asyncio.gather(w.generate(prompts[0], sampling, cached=False, subset=None),
                                    w.generate(prompts[1], sampling, cached=True, subset=hit),
                                    w.generate(prompts[2], sampling, cached=True, subset={"v": 1, "k": {}}),
                                    w.generate(prompts[0], sampling, cached=False, subset=None))  # n = 2's twin

    *outs, twin = asyncio.run(go())
    assert sorted(calls) == sorted([prompts[0], prompts[2]])  # the twin's miss took its sibling's routing
    want = [real(prompts[0]), hit, real(prompts[2])]
    assert [o["cached"] for o in outs] == [False, True, False]
    assert [o["cache_rejected"] for o in outs] == [False, False, True]  # the router drops that entry, counts a miss
    assert [o["subset"] for o in outs] == want and twin["subset"] == want[0]
    assert twin["token_ids"] == outs[0]["token_ids"]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    assert [o["token_ids"] for o in outs] == [w.engine.generate(p, greedy, s).token_ids
                                             for p, s in zip(prompts, want)]


def test_reroute_every_changes_masks_only_at_its_period(svd_llm_dir):
    engine = Engine.load(svd_llm_dir, reroute_every=4)
    lin = engine.model.projections()["layers.0.attn.q"]
    seen = []
    h = lin.register_forward_pre_hook(lambda mod, inp: seen.append(None if mod.mask is None else mod.mask.clone()))
    engine.generate("Once upon a time", SamplingParams(max_new_tokens=9, ignore_eos=True))
    h.remove()
    decode = [m for m in seen if m is not None]  # the routers' own forwards run unmasked
    assert len(decode) == 9 and all(int(m.sum()) == engine.routers.k["layers.0.attn.q"] for m in decode)
    assert all(torch.equal(decode[i], decode[0]) for i in range(4))  # prefill + 3 steps on the prefill subset


def test_static_checkpoint_has_no_routers():
    engine = Engine.load(STORIES)
    assert engine.routers is None and engine.rank_subset("Once") is None
    with pytest.raises(ValueError, match="no PARSE rank experts"):
        engine.generate("Once", SamplingParams(max_new_tokens=2), subset={"v": 1, "k": {}})


def test_work_dir_is_marked_and_a_foreign_one_refused(tmp_path):
    """Only a dir carrying the marker is a work dir (to resume in, or delete); a foreign non-empty one is refused."""
    from rankserve.compress.parse import WORK_MARKER, WorkDirMismatch, is_work_dir

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "settings.json").write_text("{}")
    kw = dict(keep=0.6, calib_text=CALIB, train_text=CALIB, steps=1, kd_steps=0, train=TRAIN, calib_tokens=2048,
              calib_seq_len=128, progress=False)
    with pytest.raises(ValueError, match=f"is not a PARSE work dir \\(it has no {WORK_MARKER}\\)"):
        build_parse_checkpoint(STORIES, tmp_path / "out", work_dir=foreign, **kw)
    assert sorted(p.name for p in foreign.iterdir()) == ["settings.json"] and not is_work_dir(foreign)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / WORK_MARKER).touch()
    (ours / "settings.json").write_text("{}")
    with pytest.raises(WorkDirMismatch, match="holds a run with other settings"):
        build_parse_checkpoint(STORIES, tmp_path / "out", work_dir=ours, **kw)
    for pool_factor, group_size in [(float("inf"), 2), (float("nan"), 2), (2.0, 0)]:
        with pytest.raises(ValueError, match="pool_factor must be a finite number|group_size must be at least 1"):
            build_parse_checkpoint(STORIES, tmp_path / "out", pool_factor=pool_factor, group_size=group_size,
                                   work_dir=tmp_path / "w", **kw)
        assert not (tmp_path / "w").exists()  # refused before the work dir is made


def test_jsonl_line_without_text_names_file_and_line(tmp_path):
    from rankserve.compress.parse import sample_windows

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Once upon a time"}\n\n["not", "an object"]\n')
    with pytest.raises(ValueError, match=f'{corpus} line 3 has no "text" string'):
        sample_windows(corpus, Tokenizer.load(STORIES), 4, 16)
    corpus.write_text('{"text": "Once"}\n{"text": \n')
    with pytest.raises(ValueError, match=f"{corpus} line 2 is not JSON"):
        sample_windows(corpus, Tokenizer.load(STORIES), 4, 16)


def test_held_out_windows_come_from_documents_of_their_own(tmp_path, capsys):
    from rankserve.compress.parse import sample_windows

    tok = Tokenizer.load(STORIES)
    words = ["cat", "dog", "sun", "tree", "boat", "king", "fish", "bird", "moon", "rain", "ship", "cake"]
    corpus = tmp_path / "c.jsonl"  # 12 documents, each one word repeated: a window's word names its document
    corpus.write_text("".join(json.dumps({"text": f" {w}" * 120}) + "\n" for w in words))
    ids = {w: set(tok.encode(f" {w}" * 8, bos=False)) for w in words}
    doc_of = lambda row: {w for w in words if set(row[1:].tolist()) <= ids[w]}  # noqa: E731

    plain = sample_windows(corpus, tok, 20, 16, seed=3)
    assert torch.equal(plain, sample_windows(corpus, tok, 20, 16, seed=3, holdout=0))  # the draw as it was
    w = sample_windows(corpus, tok, 20, 16, seed=3, holdout=5)
    assert w.shape == (20, 16) and all(len(doc_of(r)) == 1 for r in w)
    train = set().union(*map(doc_of, w[:15]))
    held = set().union(*map(doc_of, w[15:]))
    assert held and not train & held  # no held-out window shares a document with a training window

    other = tmp_path / "d.jsonl"  # six documents of other words: each file holds out its share, last
    words += ["red", "blue", "green", "gold", "pink", "gray"]
    other.write_text("".join(json.dumps({"text": f" {w}" * 120}) + "\n" for w in words[12:]))
    ids |= {w: set(tok.encode(f" {w}" * 8, bos=False)) for w in words[12:]}
    both = sample_windows([corpus, other], tok, 24, 16, seed=1, holdout=6)
    assert both.shape == (24, 16) and all(len(doc_of(r)) == 1 for r in both)
    train, held = set().union(*map(doc_of, both[:18])), set().union(*map(doc_of, both[18:]))
    assert not train & held and held & set(words[:12]) and held & set(words[12:])
    assert capsys.readouterr().err == ""

    few = tmp_path / "few.jsonl"  # one document: no held-out documents to be had, so a random split, said so
    few.write_text(json.dumps({"text": " cat" * 400}) + "\n")
    assert sample_windows(few, tok, 10, 16, holdout=2).shape == (10, 16)
    assert "too few documents" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holdout must be in"):
        sample_windows(corpus, tok, 10, 16, holdout=10)


def test_plain_text_holds_out_its_end(tmp_path):
    from rankserve.compress.parse import sample_windows

    tok = Tokenizer.load(STORIES)
    words = ["cat", "dog", "sun", "tree", "boat", "king", "fish", "bird", "moon", "rain"]
    ids = {w: set(tok.encode(f" {w}" * 8, bos=False)) for w in words}
    doc_of = lambda row: {w for w in words if set(row[1:].tolist()) <= ids[w]}  # noqa: E731
    text = tmp_path / "t.txt"  # ten "articles" of ~40 KiB: every 64 KiB piece cuts one in two
    text.write_text("".join(f" {w}" * 9000 for w in words))
    w = sample_windows(text, tok, 40, 16, seed=2, holdout=8)
    assert w.shape == (40, 16)
    rows = [doc_of(r) for r in w]
    train = set().union(*[r for r in rows[:32] if len(r) == 1])
    held = set().union(*[r for r in rows[32:] if len(r) == 1])
    assert held <= {"moon", "rain"}  # the text's end
    assert len(train & held) <= 1  # at most the article the held-out end starts in
