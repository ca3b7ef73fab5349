"""Importers of the public low-rank families (SVD-LLM v1/v2, Dobi-SVD, Basis Sharing) -> native checkpoint.

Each test writes a tiny checkpoint in the family's documented on-disk layout (shared/reference/
checkpoint-formats.md §2-§5) with our own code, imports it, loads it with `load_checkpoint` and compares
logits with a dense reference built from the same factors multiplied out (fp32, relative error <= 1e-5).
Pickled whole models are built from classes of a fake module (`component.svd_llama`, `modules.module`)
that is removed from sys.modules before the import: the restricted unpickler needs none of their code.

Run alone: .venv/bin/python -m pytest tests/test_import_lowrank.py -q
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from rankserve.compress.import_dense import dense_model
from rankserve.compress.import_lowrank import (IMPORTERS, dynamic_map, import_basis_sharing, import_dobi,
                                               import_svdllm, import_svdllm_v2)
from rankserve.workers.checkpoint import CheckpointError, load_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import ATTN_PROJS, PROJS, proj_name

CONFIGS = {
    "mha": dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False),
    "gqa": dict(vocab_size=67, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5000.0),
}
HF_BLOCK = {p: ("self_attn" if p in ATTN_PROJS else "mlp") for p in PROJS}


# --- building sources ---------------------------------------------------------------------------------

def _cfg(name: str) -> tuple[ModelConfig, dict]:
    kw = dict(CONFIGS[name], rms_norm_eps=1e-5)
    return ModelConfig.from_hf(kw), kw


def _rank(cfg: ModelConfig, i: int, p: str, hetero: bool) -> int:
    # one rank for all attention projections and one for the MLP (as SVD-LLM v1), well below break-even
    base = max(2, min(cfg.kv_dim, cfg.hidden_size) // 3) if p in ATTN_PROJS else max(2, cfg.hidden_size // 3)
    return base + (PROJS.index(p) + 2 * i) % 3 if hetero else base


def _factors(cfg: ModelConfig, seed: int, hetero: bool = False, ranks: dict | None = None) -> dict:
    """{projection: (U [out, r], V [r, in])} random fp32; `ranks` overrides single projections."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            o, inp = cfg.linear_shapes()[p]
            r = (ranks or {}).get(proj_name(i, p), _rank(cfg, i, p, hetero))
            U = torch.randn(o, r, generator=g) / r ** 0.5
            out[proj_name(i, p)] = (U, torch.randn(r, inp, generator=g) / inp ** 0.5)
    return out


def _common(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Native-named embeddings, norms (random, not ones) and head."""
    g = torch.Generator().manual_seed(seed + 1000)
    h, v = cfg.hidden_size, cfg.vocab_size
    c = {"embed.weight": torch.randn(v, h, generator=g), "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "lm_head.weight": torch.randn(v, h, generator=g) / h ** 0.5}
    for i in range(cfg.num_hidden_layers):
        c[f"layers.{i}.attn_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        c[f"layers.{i}.mlp_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return c


def _hf_common(common: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = {"model.embed_tokens.weight": common["embed.weight"], "model.norm.weight": common["norm.weight"],
          "lm_head.weight": common["lm_head.weight"]}
    for k, t in common.items():
        if k.endswith("attn_norm.weight"):
            hf[f"model.layers.{k.split('.')[1]}.input_layernorm.weight"] = t
        elif k.endswith("mlp_norm.weight"):
            hf[f"model.layers.{k.split('.')[1]}.post_attention_layernorm.weight"] = t
    return hf


@contextmanager
def _fake_module(modname: str, classes: dict[str, dict]):
    """Register `modname` (and its parents) holding nn.Module classes built from `classes`, then remove them."""
    parts = modname.split(".")
    added = []
    for j in range(1, len(parts) + 1):
        name = ".".join(parts[:j])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            added.append(name)
    mod = sys.modules[modname]
    for cls_name, body in classes.items():
        setattr(mod, cls_name, type(cls_name, (nn.Module,), {**body, "__module__": modname, "__qualname__": cls_name}))
    try:
        yield mod
    finally:
        for name in reversed(added):
            del sys.modules[name]


def _linear(W: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(W.shape[1], W.shape[0], bias=False)
    lin.weight = nn.Parameter(W.clone())
    return lin


def _svd_llm_classes() -> dict[str, dict]:
    def attn_init(self, factors):
        nn.Module.__init__(self)
        for p, (U, V) in factors.items():
            setattr(self, f"{p}_u_proj", _linear(U))
            setattr(self, f"{p}_v_proj", _linear(V))
        self.act = torch.nn.functional.silu  # a function pickled by reference: fine, it is never called

    def fwd(self, x):
        raise NotImplementedError  # never run: the importer must not need it

    return {"SVD_LlamaAttention": {"__init__": attn_init, "forward": fwd},
            "SVD_LlamaMLP": {"__init__": attn_init, "forward": fwd}}


def _hf_model(cfg_kw: dict, common: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    hf = LlamaForCausalLM(LlamaConfig(**cfg_kw))
    missing, unexpected = hf.load_state_dict(_hf_common(common), strict=False)
    assert not unexpected
    return hf


def _write_svdllm(path: Path, cfg: ModelConfig, cfg_kw: dict, factors: dict, common: dict,
                  common_dtype=torch.float16, swap: set[str] = frozenset()) -> None:
    """SVD-LLM v1 `.pt`: a pickled LlamaForCausalLM whose attention/MLP are `component.svd_llama` modules.

    As SVD-LLM writes it: fp32 factors inside an fp16 model; `swap` names projections whose u/v
    children hold each other's factor (the importer must orient by shape).
    """
    with _fake_module("component.svd_llama", _svd_llm_classes()) as mod:
        hf = _hf_model(cfg_kw, common).to(common_dtype)
        for i, layer in enumerate(hf.model.layers):
            def pick(p):
                U, V = factors[proj_name(i, p)]
                return (V, U) if proj_name(i, p) in swap else (U, V)
            layer.self_attn = mod.SVD_LlamaAttention({p: pick(p) for p in ("q", "k", "v", "o")})
            layer.mlp = mod.SVD_LlamaMLP({p: pick(p) for p in ("gate", "up", "down")})
        torch.save({"model": hf, "tokenizer": None}, path)


def _dobi_classes() -> dict[str, dict]:
    def init(self, U, V):
        nn.Module.__init__(self)
        self.ALinear = _linear(V)  # applied first: V [r, in]
        self.BLinear = _linear(U)  # applied second: U [out, r]

    return {"SVDTransformLayer": {"__init__": init, "forward": lambda self, x: self.BLinear(self.ALinear(x))}}


def _write_dobi(path: Path, cfg_kw: dict, factors: dict, common: dict, dense: dict) -> None:
    """Dobi no-remapping `DobiSVD_Model.pt`: every Linear replaced by `modules.module.SVDTransformLayer`, fp16."""
    with _fake_module("modules.module", _dobi_classes()) as mod:
        hf = _hf_model(cfg_kw, common)
        for i, layer in enumerate(hf.model.layers):
            for p in PROJS:
                parent = getattr(layer, HF_BLOCK[p])
                name = proj_name(i, p)
                if name in dense:  # a module Dobi left as a plain Linear
                    setattr(parent, f"{p}_proj", _linear(dense[name]))
                else:
                    setattr(parent, f"{p}_proj", mod.SVDTransformLayer(*factors[name]))
        torch.save({"model": hf.half(), "tokenizer": None}, path)


# --- reference and checks -------------------------------------------------------------------------

def _reference_logits(cfg: ModelConfig, common: dict, weights: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Dense fp32 model from `weights[name]` = (U, V) (multiplied out) or W."""
    native = {k: v.float() for k, v in common.items()}
    if cfg.tie_word_embeddings:
        native.pop("lm_head.weight", None)
    for name, w in weights.items():
        native[f"{name}.weight"] = w.float() if isinstance(w, torch.Tensor) else w[0].float() @ w[1].float()
    with torch.no_grad():
        return dense_model(cfg, native).eval()(tokens)


def _check_logits(out: Path, cfg: ModelConfig, common: dict, weights: dict) -> tuple:
    model, man = load_checkpoint(out, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model(tokens)
    ref = _reference_logits(cfg, common, weights, tokens)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, f"relative logit error {rel:.3g}"
    return model, man


def _expected_keep(cfg: ModelConfig, weights: dict, groups: dict[str, list[str]] | None = None) -> float:
    shapes, kept = cfg.linear_shapes(), 0
    grouped = {m for ms in (groups or {}).values() for m in ms}
    for name, w in weights.items():
        o, inp = shapes[name.rsplit(".", 1)[1]]
        if isinstance(w, torch.Tensor):
            kept += o * inp
        else:
            r = w[1].shape[0]
            kept += o * r + (0 if name in grouped else r * inp)
    for ms in (groups or {}).values():
        kept += weights[ms[0]][1].shape[0] * shapes[ms[0].rsplit(".", 1)[1]][1]
    return round(kept / cfg.dense_linear_params(), 6)


def _assert_refused(fn, tmp_path: Path, *match: str) -> str:
    """fn() raises a one-line CheckpointError mentioning each of `match`, leaving no output behind."""
    before = set(tmp_path.iterdir())
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for m in match:
        assert m in msg, msg
    assert set(tmp_path.iterdir()) == before, "a failed import left files behind"
    return msg


# --- SVD-LLM --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_svdllm_pickle_imports_without_its_code(tmp_path, name):
    cfg, kw = _cfg(name)
    factors, common = _factors(cfg, seed=1), _common(cfg, seed=1)
    src = tmp_path / "jeffwan_llama_7b_hf_whitening_only_0.8.pt"
    _write_svdllm(src, cfg, kw, factors, common)
    assert "component.svd_llama" not in sys.modules and "component" not in sys.modules
    out = import_svdllm(src, tmp_path / "out")
    model, man = _check_logits(out, cfg, {k: v.half() for k, v in common.items()}, factors)
    assert man.family == "svd-llm" and man.source == src.name
    assert man.keep == _expected_keep(cfg, factors)
    assert all(man.ranks[n] == f[1].shape[0] for n, f in factors.items())
    prov = man.provenance
    assert prov["config_from"] == "pickle" and prov["layout"] == "pickled-model"
    assert prov["dtypes_found"] == ["float16", "float32"] and prov["stored_dtype"] == "float32"
    assert len(prov["sha256"][src.name]) == 64
    assert all(prov["rank_uniform"]["qkv"]) and all(prov["rank_uniform"]["gate_up"])
    assert prov["tokenizer"].startswith("none")
    assert not list(out.glob("tokenizer*"))


def test_svdllm_trust_pickle_gives_the_same_model(tmp_path):
    cfg, kw = _cfg("mha")
    factors, common = _factors(cfg, seed=2), _common(cfg, seed=2)
    src = tmp_path / "m.pt"
    _write_svdllm(src, cfg, kw, factors, common, common_dtype=torch.float32)
    with _fake_module("component.svd_llama", _svd_llm_classes()):  # the real classes, as a user who trusts it
        out = import_svdllm(src, tmp_path / "trusted", trust_pickle=True)
    _, man = _check_logits(out, cfg, common, factors)
    assert man.provenance["stored_dtype"] == "float32"
    _check_logits(import_svdllm(src, tmp_path / "restricted"), cfg, common, factors)
    a, b = (safe_open(str(p / "model.safetensors"), "pt") for p in (out, tmp_path / "restricted"))
    assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_svdllm_v2_heterogeneous_ranks_and_tokenizer(tmp_path):
    cfg, kw = _cfg("gqa")
    factors, common = _factors(cfg, seed=3, hetero=True), _common(cfg, seed=3)
    src_dir = tmp_path / "v2"
    src_dir.mkdir()
    _write_svdllm(src_dir / "svdllm_v2.pt", cfg, kw, factors, common)
    (src_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    out = import_svdllm_v2(src_dir, tmp_path / "out")
    _, man = _check_logits(out, cfg, {k: v.half() for k, v in common.items()}, factors)
    assert man.family == "svd-llm-v2" and man.keep == _expected_keep(cfg, factors)
    flags = man.provenance["rank_uniform"]
    want_qkv = [len({factors[proj_name(i, p)][1].shape[0] for p in "qkv"}) == 1 for i in range(cfg.num_hidden_layers)]
    assert flags["qkv"] == want_qkv and not all(want_qkv)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert man.provenance["tokenizer"].startswith("copied")


def test_state_dict_orientation_by_shape_and_config_beside(tmp_path):
    """A safetensors state dict with SVD-LLM names, some u/v swapped: shapes decide; config.json beside it."""
    cfg, kw = _cfg("gqa")
    factors, common = _factors(cfg, seed=4, hetero=True), _common(cfg, seed=4)
    swap = {proj_name(0, "gate"), proj_name(1, "k"), proj_name(2, "down")}  # non-square: unambiguous by shape
    sd = _hf_common(common)
    for name, (U, V) in factors.items():
        i, p = int(name.split(".")[1]), name.rsplit(".", 1)[1]
        u, v = (V, U) if name in swap else (U, V)
        sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_u_proj.weight"] = u.contiguous()
        sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_v_proj.weight"] = v.contiguous()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # ignored buffer
    src_dir = tmp_path / "sd"
    src_dir.mkdir()
    save_file(sd, str(src_dir / "model.safetensors"))
    (src_dir / "config.json").write_text(json.dumps(kw))
    out = import_svdllm(src_dir, tmp_path / "out")
    _, man = _check_logits(out, cfg, common, factors)
    assert man.provenance["config_from"] == "config.json" and man.provenance["layout"] == "state-dict"
    # the same tensors as a .pt state dict with an explicit config argument
    torch.save(sd, tmp_path / "sd.pt")
    _check_logits(import_svdllm(tmp_path / "sd.pt", tmp_path / "out2", config=src_dir), cfg, common, factors)


def test_densify_above_break_even(tmp_path):
    cfg, kw = _cfg("mha")  # q is 32x32: break-even rank 16
    big = {proj_name(0, "q"): 20, proj_name(1, "down"): 32}  # down is 32x48: break-even 19.2, r = min = 32
    factors, common = _factors(cfg, seed=5, ranks=big), _common(cfg, seed=5)
    src = tmp_path / "m.pt"
    _write_svdllm(src, cfg, kw, factors, common, common_dtype=torch.float32)
    out = import_svdllm(src, tmp_path / "out")
    model, man = _check_logits(out, cfg, common, factors)
    assert sorted(man.provenance["densified"]) == sorted(big)
    assert all(man.ranks[n] is None for n in big)
    weights = {n: (f[0] @ f[1] if n in big else f) for n, f in factors.items()}
    assert man.keep == _expected_keep(cfg, weights)


# --- Dobi-SVD -------------------------------------------------------------------------------------

def test_dobi_noremap_pickle(tmp_path, monkeypatch):
    cfg, kw = _cfg("gqa")
    factors = {n: (U.half(), V.half()) for n, (U, V) in _factors(cfg, seed=6, hetero=True).items()}
    common = {k: v.half() for k, v in _common(cfg, seed=6).items()}
    dense_name = proj_name(1, "o")
    dense = {dense_name: torch.randn(cfg.hidden_size, cfg.q_dim).half() / 8}
    src_dir = tmp_path / "DobiSVD_Noremapping-tiny-0.4"
    src_dir.mkdir()
    with monkeypatch.context() as m:  # Dobi saves from the GPU: record every storage as living on cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        _write_dobi(src_dir / "DobiSVD_Model.pt", kw, factors, common, dense)
    assert "modules.module" not in sys.modules
    with zipfile.ZipFile(src_dir / "DobiSVD_Model.pt") as z:
        assert b"cuda:0" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    out = import_dobi(src_dir, tmp_path / "out")
    weights = {**factors, **dense}
    _, man = _check_logits(out, cfg, common, weights)
    assert man.family == "dobi-svd" and man.provenance["stored_dtype"] == "float16"
    assert man.ranks[dense_name] is None
    assert man.ranks[proj_name(0, "q")] == factors[proj_name(0, "q")][0].shape[1]  # U = BLinear, V = ALinear
    assert man.keep == _expected_keep(cfg, weights)


def _quantize(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (k, n) -> (uint8 map indices, fp16 absmax per row), as bitsandbytes' `quantize` does per vector."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    idx = (x / absmax)[..., None].sub(code).abs().argmin(-1)
    return idx.to(torch.uint8), absmax[:, 0].half()


def test_dynamic_map_matches_bitsandbytes():
    code = dynamic_map()
    assert code.shape == (256,) and torch.all(code[1:] >= code[:-1])
    assert code[127] == 0 and code[255] == 1.0 and (code == 0).sum() == 1
    assert code[0].item() == pytest.approx(-(1 - 0.9 / 128))  # largest magnitude: last of 64 midpoints in [0.1, 1]
    assert code[128].item() == pytest.approx(0.55e-6)  # smallest: the single midpoint of [0.1, 1] times 1e-6


def test_dobi_remapping_dir(tmp_path):
    cfg, kw = _cfg("mha")
    code = dynamic_map()
    common = {k: v.half() for k, v in _common(cfg, seed=8).items()}
    g = torch.Generator().manual_seed(8)
    remap, weights = {}, {}
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            o, n = cfg.linear_shapes()[p]
            k = 30 if (i, p) == (1, "up") else 3 + (i + PROJS.index(p)) % 4  # up 48x32, k=30: above break-even
            us, vt = torch.randn(o, k, generator=g), torch.randn(k, n, generator=g) / n ** 0.5
            m = min(o, n)
            uq, ua = _quantize(us[:m].T, code)  # columns of U (first min(out, in) rows)
            vq, va = _quantize(vt[:, :m], code)
            tail = ("us", us[m:].half()) if o > n else ("vt", vt[:, m:].half()) if n > o else None
            remap[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_proj"] = dict(
                us_quan=uq, vt_quan=vq, us_absmax=ua, vt_absmax=va, tuple_info=tail)
            U = code[uq.long()].T * ua.float()
            V = va.float()[:, None] * code[vq.long()]
            if tail is not None:
                rest = tail[1].float()
                U, V = (torch.cat([U, rest]), V) if tail[0] == "us" else (U, torch.cat([V, rest], 1))
            U, V = U.half(), V.half()
            dense = k * (o + n) >= o * n
            weights[proj_name(i, p)] = (U.float() @ V.float()).half() if dense else (U, V)
    src = tmp_path / "DobiSVD-tiny-0.4"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(kw))
    torch.save(_hf_common(common), src / "pytorch_model.bin")
    torch.save(remap, src / "remapping_weight.pt")
    out = import_dobi(src, tmp_path / "out")
    _, man = _check_logits(out, cfg, common, weights)
    assert man.provenance["layout"] == "remapping" and man.provenance["densified"] == [proj_name(1, "up")]
    assert man.keep == _expected_keep(cfg, weights)


# --- Basis Sharing ----------------------------------------------------------------------------------

def _write_basis_sharing(src: Path, cfg: ModelConfig, kw: dict, common: dict, seed: int,
                         share=("q", "k", "v", "gate", "up"), break_group: str | None = None) -> tuple[dict, dict]:
    """ShareLlama HF dir: config.json with num_basis_* / *_groups, pytorch_model.bin with aliased basis keys."""
    L, shapes = cfg.num_hidden_layers, cfg.linear_shapes()
    g = torch.Generator().manual_seed(seed)
    shared_groups = [list(range(j, min(j + 2, L))) for j in range(0, L, 2)]  # [[0, 1], [2]] as Basis Sharing makes
    conf = dict(kw, architectures=["ShareLlamaForCausalLM"], model_type="llama")
    sd = _hf_common(common)
    weights, groups = {}, {}
    for p in PROJS:
        o, n = shapes[p]
        r = 4 + PROJS.index(p) % 3
        gl = shared_groups if p in share else [[i] for i in range(L)]
        conf[f"num_basis_{p}"], conf[f"{p}_groups"] = r, gl
        for members in gl:
            basis = torch.randn(r, n, generator=g) / n ** 0.5  # one tensor: every key below aliases it
            for i in members:
                U = torch.randn(o, r, generator=g) / r ** 0.5
                V = basis.clone() if f"{p}.{i}" == break_group else basis
                if V is not basis:
                    V[0, 0] += 1e-3
                sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_proj.weight"] = U
                sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_basis.weight"] = V
                sd[f"model.{p}_basis.{i}.weight"] = V  # the ShareLlamaModel-level ModuleDict alias
                weights[proj_name(i, p)] = (U, V)
            if len(members) > 1:
                groups[f"{p}.{members[0]}-{members[-1]}"] = [proj_name(i, p) for i in members]
    src.mkdir()
    (src / "config.json").write_text(json.dumps(conf))
    torch.save(sd, src / "pytorch_model.bin")
    (src / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    return weights, groups


def test_basis_sharing_one_storage_per_group(tmp_path):
    cfg, kw = _cfg("gqa")
    common = _common(cfg, seed=9)
    src = tmp_path / "share_llama-tiny_20"
    weights, groups = _write_basis_sharing(src, cfg, kw, common, seed=9)
    out = import_basis_sharing(src, tmp_path / "out")
    model, man = _check_logits(out, cfg, common, weights)
    assert man.groups == groups and len(groups) == 5  # q, k, v, gate, up over layers 0-1; layer 2 alone
    assert man.keep == _expected_keep(cfg, weights, groups)
    layers = model.projections()
    for g, members in groups.items():
        ptrs = {layers[m].V.data_ptr() for m in members}
        assert len(ptrs) == 1 and all(layers[m].V is layers[members[0]].V for m in members), g
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {k for k in keys if k.startswith("bases.")} == {f"bases.{g}.V" for g in groups}
    grouped = {m for ms in groups.values() for m in ms}
    assert not any(f"{m}.V" in keys for m in grouped)  # each basis stored once
    assert all(f"{m}.U" in keys for m in grouped)
    assert (out / "tokenizer.model").read_bytes() == b"\x00sentencepiece"
    assert man.provenance["rank_uniform"] == {"qkv": [False] * 3, "gate_up": [False] * 3}


def test_basis_sharing_refuses_unequal_group_bases(tmp_path):
    cfg, kw = _cfg("mha")
    src = tmp_path / "share"
    _write_basis_sharing(src, cfg, kw, _common(cfg, seed=10), seed=10, break_group="k.1")
    _assert_refused(lambda: import_basis_sharing(src, tmp_path / "out"), tmp_path, "k_basis", "bit-identical")


def test_basis_sharing_dir_imported_as_svdllm_names_the_family(tmp_path):
    cfg, kw = _cfg("mha")
    src = tmp_path / "share"
    _write_basis_sharing(src, cfg, kw, _common(cfg, seed=11), seed=11)
    _assert_refused(lambda: import_svdllm(src, tmp_path / "out"), tmp_path, "--family basis-sharing")


def test_basis_sharing_refuses_plain_llama_dir(tmp_path):
    cfg, kw = _cfg("mha")
    src = tmp_path / "share"
    _write_basis_sharing(src, cfg, kw, _common(cfg, seed=11), seed=11)
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(conf, architectures=["LlamaForCausalLM"])))
    _assert_refused(lambda: import_basis_sharing(src, tmp_path / "out"), tmp_path, "ShareLlamaForCausalLM")


# --- malicious and bad input -------------------------------------------------------------------------

class _SystemCall:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload", [_SystemCall, _Eval])
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, payload, writer):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    obj = {"model": payload(marker), "tokenizer": None}
    if writer == "torch.save":
        torch.save(obj, src)
    else:
        with open(src, "wb") as f:
            pickle.dump(obj, f, protocol=2)
    for fn in (import_svdllm, import_dobi):
        _assert_refused(lambda: fn(src, tmp_path / "out"), tmp_path, "--trust-pickle")
    assert not marker.exists(), "the pickled call ran"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_archive_is_refused(tmp_path):
    torch.jit.save(torch.jit.script(nn.Linear(4, 4)), tmp_path / "scripted.pt")
    _assert_refused(lambda: import_svdllm(tmp_path / "scripted.pt", tmp_path / "out"), tmp_path, "TorchScript")


def test_malicious_object_inside_a_model_is_refused(tmp_path):
    cfg, kw = _cfg("mha")
    marker = tmp_path / "pwned"
    src = tmp_path / "m.pt"
    with _fake_module("component.svd_llama", _svd_llm_classes()) as mod:
        hf = _hf_model(kw, _common(cfg, seed=12))
        hf.model.layers[0].self_attn = mod.SVD_LlamaAttention(
            {p: f for p, f in zip("qkvo", list(_factors(cfg, seed=12).values())[:4])})
        hf.model.layers[0].self_attn.hook = _SystemCall(marker)  # a plain attribute, deep in the tree
        torch.save({"model": hf, "tokenizer": None}, src)
    msg = _assert_refused(lambda: import_svdllm(src, tmp_path / "out"), tmp_path, "system", "--trust-pickle")
    assert not marker.exists(), msg


def test_bad_inputs_are_one_line_errors_without_output(tmp_path):
    cfg, kw = _cfg("mha")
    factors, common = _factors(cfg, seed=13), _common(cfg, seed=13)
    good = tmp_path / "good.pt"
    _write_svdllm(good, cfg, kw, factors, common)
    out = tmp_path / "out"

    def write_sd(name: str, edit) -> Path:
        sd = _hf_common(common)
        for n, (U, V) in factors.items():
            i, p = int(n.split(".")[1]), n.rsplit(".", 1)[1]
            sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_u_proj.weight"] = U
            sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_v_proj.weight"] = V
        edit(sd)
        torch.save(sd, tmp_path / name)
        return tmp_path / name

    _assert_refused(lambda: import_svdllm(tmp_path / "missing.pt", out), tmp_path, "does not exist")
    missing = write_sd("missing_key.pt", lambda sd: sd.pop("model.layers.1.mlp.up_v_proj.weight"))
    _assert_refused(lambda: import_svdllm(missing, out, config=kw), tmp_path, "model.layers.1.mlp.up_v_proj.weight")
    wrong = write_sd("wrong.pt", lambda sd: sd.update({"model.layers.0.self_attn.k_v_proj.weight": torch.randn(4, 31)}))
    _assert_refused(lambda: import_svdllm(wrong, out, config=kw), tmp_path, "layers.0.attn.k", "[4, 31]")
    big = write_sd("big.pt", lambda sd: sd.update({"model.layers.0.self_attn.q_u_proj.weight": torch.randn(32, 40),
                                                   "model.layers.0.self_attn.q_v_proj.weight": torch.randn(40, 32)}))
    _assert_refused(lambda: import_svdllm(big, out, config=kw), tmp_path, "rank 40", "min(out, in) = 32")
    norm = write_sd("norm.pt", lambda sd: sd.pop("model.norm.weight"))
    _assert_refused(lambda: import_svdllm(norm, out, config=kw), tmp_path, "norm.weight")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    _assert_refused(lambda: import_svdllm(tmp_path / "list.pt", out, config=kw), tmp_path, "unknown layout")
    (tmp_path / "junk.pt").write_bytes(b"not a pickle at all")
    _assert_refused(lambda: import_svdllm(tmp_path / "junk.pt", out, config=kw), tmp_path, "junk.pt")
    no_cfg = write_sd("no_cfg.pt", lambda sd: None)
    _assert_refused(lambda: import_svdllm(no_cfg, out), tmp_path, "no model config")
    # a Dobi file imported as SVD-LLM: a family hint, not a crash
    dobi_dir = tmp_path / "dobi"
    dobi_dir.mkdir()
    _write_dobi(dobi_dir / "DobiSVD_Model.pt", kw, {n: (U.half(), V.half()) for n, (U, V) in factors.items()},
                {k: v.half() for k, v in common.items()}, {})
    _assert_refused(lambda: import_svdllm(dobi_dir, out), tmp_path, "--family dobi-svd")
    dense_sd = _hf_common(common)
    for n, (U, V) in factors.items():
        i, p = int(n.split(".")[1]), n.rsplit(".", 1)[1]
        dense_sd[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_proj.weight"] = U @ V
    torch.save(dense_sd, tmp_path / "dense.bin")
    _assert_refused(lambda: import_svdllm(tmp_path / "dense.bin", out, config=kw), tmp_path, "--family hf")
    out.mkdir()
    _assert_refused(lambda: import_svdllm(good, out), tmp_path, "already exists")


def test_unreadable_torch_files_are_not_called_pickles_needing_code(tmp_path):
    """Only torch's weights-only refusal of a callable means "needs code"; a truncated, empty or garbage file (or
    one that makes the unpickler allocate without bound) is unreadable, on the trusted path too."""
    import struct

    from rankserve.compress.safe_load import load_torch_file, load_torch_pickle

    torch.save({"w": torch.zeros(3)}, tmp_path / "good.bin")
    whole = (tmp_path / "good.bin").read_bytes()
    files = {"trunc.bin": whole[:len(whole) // 2], "empty.bin": b"", "garbage.bin": b"hello garbage " * 10,
             "huge.bin": b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 62) + b"x"}  # BINBYTES8 of 4 EiB: MemoryError
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        for load in (load_torch_file, load_torch_pickle):
            for trust in (False, True):
                msg = _assert_refused(lambda: load(tmp_path / name, trust_pickle=trust), tmp_path, name, "not a readable")
                assert "needs arbitrary" not in msg and "--trust-pickle" not in msg, msg
    torch.save({"model": _SystemCall(tmp_path / "pwned")}, tmp_path / "evil.bin")
    _assert_refused(lambda: load_torch_file(tmp_path / "evil.bin"), tmp_path, "needs arbitrary pickled code",
                    "system", "--trust-pickle")
    assert not (tmp_path / "pwned").exists()


def test_corrupt_safetensors_in_an_hf_dir_is_a_checkpoint_error(tmp_path):
    from rankserve.compress.import_dense import import_hf

    src = tmp_path / "src"
    src.mkdir()
    cfg, kw = _cfg("mha")
    (src / "config.json").write_text(json.dumps(kw))
    (src / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    _assert_refused(lambda: import_hf(src, tmp_path / "out"), tmp_path, "model.safetensors",
                    "is not a readable safetensors file")


def test_importers_table():
    assert set(IMPORTERS) == {"hf", "llama2c", "svd-llm", "svd-llm-v2", "dobi-svd", "basis-sharing"}
    import inspect

    for family, fn in IMPORTERS.items():
        assert "trust_pickle" in inspect.signature(fn).parameters, family


def test_kernels_wrapped_function_loads_as_an_inert_stub():
    """transformers >= 5.25 with the `kernels` package pickles a wrapped activation as a call of
    `kernels._internals.layer.layer._rebuild_kernel_func(module, name)`, which would import `module`: the
    restricted unpickler stands an inert stub in for it (here the names ask for os.system; nothing runs)."""
    import io

    from rankserve.compress.safe_load import Stub, _restricted_load

    def text(s: str) -> bytes:
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    data = (b"\x80\x02ckernels._internals.layer.layer\n_rebuild_kernel_func\n" + text("os") + text("system")
            + b"\x86R}" + text("training") + b"\x89sb.")  # (module, name) REDUCE, then BUILD {"training": False}
    obj = _restricted_load(io.BytesIO(data))
    assert isinstance(obj, Stub) and obj.stub_name == "os.system" and obj.__dict__ == {"training": False}
    bad = b"\x80\x02ckernels._internals.layer.layer\n_rebuild_kernel_func\nK\x01K\x02\x86R."
    with pytest.raises(pickle.UnpicklingError):
        _restricted_load(io.BytesIO(bad))


def test_biases_and_integer_weights_are_refused_not_dropped(tmp_path):
    """A dense HF dir with non-zero projection biases, or int8 weights (a quantized export), and a low-rank source with
    an int8 dense projection fail with a line naming the tensor instead of importing into a model with other logits;
    all-zero biases change nothing and import."""
    from rankserve.compress.import_dense import import_hf

    cfg, kw = _cfg("mha")
    hf = LlamaForCausalLM(LlamaConfig(**kw, attention_bias=True, mlp_bias=True))
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    def write(name: str, edit) -> Path:
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_text(json.dumps(kw))
        tensors = dict(sd)
        edit(tensors)
        save_file(tensors, str(src / "model.safetensors"))
        return src

    biased = write("biased", lambda t: t.update({"model.layers.1.mlp.down_proj.bias": torch.randn(cfg.hidden_size)}))
    _assert_refused(lambda: import_hf(biased, tmp_path / "out"), tmp_path, "model.layers.1.mlp.down_proj.bias",
                    "non-zero bias")
    int8 = write("int8", lambda t: t.update({k: v.round().to(torch.int8) for k, v in t.items()
                                             if k.endswith("q_proj.weight")}))
    _assert_refused(lambda: import_hf(int8, tmp_path / "out"), tmp_path, "layers.0.attn.q.weight is int8")
    lowrank = _hf_common(_common(cfg, seed=14))  # svd-llm factors, one projection left dense, in int8
    for n, (U, V) in _factors(cfg, seed=14).items():
        i, p = int(n.split(".")[1]), n.rsplit(".", 1)[1]
        lowrank[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_u_proj.weight"] = U
        lowrank[f"model.layers.{i}.{HF_BLOCK[p]}.{p}_v_proj.weight"] = V
    del lowrank["model.layers.0.self_attn.o_u_proj.weight"], lowrank["model.layers.0.self_attn.o_v_proj.weight"]
    lowrank["model.layers.0.self_attn.o_proj.weight"] = torch.ones(cfg.hidden_size, cfg.q_dim, dtype=torch.int8)
    torch.save(lowrank, tmp_path / "lowrank.pt")
    _assert_refused(lambda: import_svdllm(tmp_path / "lowrank.pt", tmp_path / "out", config=kw), tmp_path,
                    "model.layers.0.self_attn.o_proj.weight", "torch.int8")
    zero = write("zero", lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items() if k.endswith(".bias")}))
    out = import_hf(zero, tmp_path / "out")
    model, _ = load_checkpoint(out)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for k, v in hf.named_parameters():
            if k.endswith(".bias"):
                v.zero_()
        ref = hf(tokens).logits
        assert ((model(tokens) - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_hf_dir_reads_only_the_shards_its_index_names(tmp_path):
    """A repository with a shard index may also ship the weights in another layout (a consolidated file): only the
    indexed shards are read. An index naming a missing shard, or not an index, is a one-line error."""
    from rankserve.compress.import_dense import read_hf_tensors

    src = tmp_path / "src"
    src.mkdir()
    a, b = {"x.weight": torch.ones(2)}, {"y.weight": torch.zeros(3)}
    save_file(a, str(src / "model-00001-of-00002.safetensors"))
    save_file(b, str(src / "model-00002-of-00002.safetensors"))
    save_file({"consolidated.x": torch.ones(4)}, str(src / "consolidated.safetensors"))
    index = {"metadata": {}, "weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                                            "y.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(read_hf_tensors(src)) == ["x.weight", "y.weight"]
    index["weight_map"]["z.weight"] = "model-00003-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names model-00003-of-00002.safetensors, which is not a file"):
        read_hf_tensors(src)
    (src / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a shard index"):
        read_hf_tensors(src)
