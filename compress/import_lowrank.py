"""Importers of the public low-rank LLaMA families into the native checkpoint, and the `IMPORTERS` table.

family          source on disk                                         U [out, r]          V [r, in]
svd-llm(-v2)    pickle `{'model', 'tokenizer'}` .pt, or a state dict   {p}_u_proj.weight   {p}_v_proj.weight
                (.pt / .bin / .safetensors) with the same keys
dobi-svd        pickle `DobiSVD_Model.pt` (no remapping)               {p}_proj.BLinear    {p}_proj.ALinear
dobi-svd        dir: remapping_weight.pt (8-bit) + pytorch_model.bin   dequantized `us`    dequantized `vt`
basis-sharing   HF dir, `ShareLlamaForCausalLM`, .bin / .safetensors   {p}_proj.weight     {p}_basis.weight,
                                                                                           one per `{p}_groups` entry
(keys under `model.layers.{i}.{self_attn|mlp}.`; layouts in shared/reference/checkpoint-formats.md §2-§5, §7.)

Rules shared by every family:
- U vs V is decided by shape against the config's (out, in) (§8.2); the family's forward order (the factor
  applied first is V) only breaks the tie when out == in == r.
- A rank above min(out, in) is refused. A factorization no smaller than the dense matrix
  (r·(out + in) ≥ out·in) is stored dense as U @ V (exact, fewer parameters, one GEMM), as Dobi-SVD's own
  loader does; such projections are listed in provenance["densified"]. Shared bases are never densified.
- The stored dtype is the source's when all its tensors share one, else float32 (SVD-LLM keeps fp32 factors
  in an fp16 model): nothing is rounded at import; `load_checkpoint(dtype=...)` picks the serving dtype.
- Pickles are read without running their code (`safe_load.load_torch_pickle`). The pickled tokenizer is never
  used: tokenizer.model / tokenizer.json beside the source are copied when present, else none is written.
- Everything is validated before `save_checkpoint`, which writes atomically: a failed import leaves no output.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rankserve.compress.import_dense import hf_common_name, import_hf, import_llama2c, read_hf_config, read_hf_tensors
from rankserve.compress.safe_load import Stub, load_torch_file, load_torch_pickle, stub_attrs, stub_tensors
from rankserve.workers.checkpoint import CheckpointError, Manifest, save_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import ATTN_PROJS, PROJS, Transformer, _group_key, proj_name

ConfigArg = str | Path | dict | ModelConfig | None  # a config.json (or its directory), an HF config dict, a config


@dataclass(frozen=True)
class _Layout:
    """Key stems of one projection's factors under `layers.{i}.{self_attn|mlp}.` ({p} = q, k, ..., down)."""
    first: str  # applied first in the family's forward: V when shapes cannot tell
    second: str  # applied second: U
    dense: str | None  # a projection the method left as a plain Linear, if the family allows it


LAYOUTS = {
    "svd-llm": _Layout("{p}_v_proj", "{p}_u_proj", "{p}_proj"),
    "dobi-svd": _Layout("{p}_proj.ALinear", "{p}_proj.BLinear", "{p}_proj"),
    "basis-sharing": _Layout("{p}_basis", "{p}_proj", None),
}


# --- public importers ------------------------------------------------------------------------------

def import_svdllm(src: str | Path, out: str | Path, trust_pickle: bool = False, config: ConfigArg = None) -> Path:
    """SVD-LLM v1 (or FlashSVD) `.pt` -> native checkpoint. `src`: the file, or a directory holding one .pt.

    `config` overrides the model config; by default it is the HF config pickled inside the model, else a
    config.json beside the file.
    """
    return _import_pickled(src, out, "svd-llm", LAYOUTS["svd-llm"], trust_pickle, config)


def import_svdllm_v2(src: str | Path, out: str | Path, trust_pickle: bool = False, config: ConfigArg = None) -> Path:
    """SVD-LLM v2-style `.pt` (v1 layout, per-matrix ranks) -> native checkpoint; as `import_svdllm`."""
    return _import_pickled(src, out, "svd-llm-v2", LAYOUTS["svd-llm"], trust_pickle, config)


def import_dobi(src: str | Path, out: str | Path, trust_pickle: bool = False, config: ConfigArg = None) -> Path:
    """Dobi-SVD -> native checkpoint.

    `src` a `DobiSVD_Model.pt` pickle (or its directory): no-remapping layout, U = BLinear, V = ALinear.
    `src` a directory with `remapping_weight.pt`: remapping layout, 8-bit factors dequantized to fp16.
    """
    src = Path(src)
    if src.is_dir() and (src / "remapping_weight.pt").is_file():
        return _import_dobi_remap(src, Path(out), trust_pickle, config)
    return _import_pickled(src, out, "dobi-svd", LAYOUTS["dobi-svd"], trust_pickle, config)


def import_basis_sharing(src: str | Path, out: str | Path, trust_pickle: bool = False,
                         config: ConfigArg = None) -> Path:
    """Basis Sharing HF directory (`ShareLlamaForCausalLM`) -> native checkpoint with one basis per group.

    Members of a `{p}_groups` entry must hold bit-identical bases; the native group is named after the
    projection and its layers (`q.0-1`) and its basis is stored once (`bases.q.0-1.V`).
    """
    src, out = Path(src), Path(out)
    _check_out(out)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory (a Basis Sharing checkpoint is an HF model directory)")
    file_cfg, raw = read_hf_config(src)
    archs = raw.get("architectures") or []
    if not any("sharellama" in str(a).lower() for a in archs):
        raise CheckpointError(f"{src / 'config.json'}: architectures {archs} is not ShareLlamaForCausalLM "
                              "(not a Basis Sharing LLaMA checkpoint)")
    cfg, cfg_from = (file_cfg, "config.json") if config is None else _config_arg(config)
    files = sorted(src.glob("*.safetensors")) or sorted(src.glob("pytorch_model*.bin"))
    t = _strip(read_hf_tensors(src, trust_pickle))
    _check_layers(cfg, t, src)
    shapes, L = cfg.linear_shapes(), cfg.num_hidden_layers
    factors: dict[str, Any] = {}
    groups: dict[str, tuple[list[str], torch.Tensor]] = {}
    used: list[torch.Tensor] = []
    densified: list[str] = []
    for p in PROJS:
        out_f, in_f = shapes[p]
        n_basis = raw.get(f"num_basis_{p}")
        if n_basis is None:  # the method left this projection type dense
            for i in range(L):
                factors[proj_name(i, p)] = _dense(t, f"{_block(i, p)}{p}_proj.weight", out_f, in_f)
                used.append(factors[proj_name(i, p)])
            continue
        if not isinstance(n_basis, int) or n_basis <= 0:
            raise CheckpointError(f"{src / 'config.json'}: num_basis_{p} must be a positive integer, got {n_basis!r}")
        for members in _share_groups(raw, p, L):
            pairs = []
            for i in members:
                name, blk = proj_name(i, p), _block(i, p)
                v_key = f"{blk}{p}_basis.weight"
                if v_key not in t and f"{p}_basis.{i}.weight" in t:  # only the model-level alias was saved
                    v_key = f"{p}_basis.{i}.weight"
                U, V = _factor_pair(t, name, v_key, f"{blk}{p}_proj.weight", out_f, in_f, "basis-sharing")
                if V.shape[0] != n_basis:
                    raise CheckpointError(f"tensor model.{v_key} has rank {V.shape[0]}, but config.json says "
                                          f"num_basis_{p} = {n_basis}")
                pairs.append((name, U, V, v_key))
                used += [U, V]
            if len(members) == 1:
                name, U, V, _ = pairs[0]
                factors[name] = _settle(name, U, V, out_f, in_f, densified)
                continue
            _, _, V0, key0 = pairs[0]
            for name, _, V, key in pairs[1:]:
                if V.shape != V0.shape or not torch.equal(V, V0):
                    raise CheckpointError(f"tensors model.{key0} and model.{key} are in one {p}_groups entry "
                                          f"{members} but are not bit-identical; a shared basis must be one tensor")
            for name, U, _, _ in pairs:
                factors[name] = (U, V0)
            groups[_group_name(p, members)] = ([name for name, *_ in pairs], V0)
    common, used_common = _common(cfg, t, src)
    model, store = _build(cfg, common, factors, groups, used + used_common)
    prov = dict(importer="basis-sharing", layout="hf-dir", config_from=cfg_from, sha256=_sha256(files))
    return _save(out, model, "basis-sharing", src, prov, _dtypes(used + used_common), store, densified,
                 tokenizer_dir=_tokenizer_dir(src))


# --- pickled whole models (SVD-LLM, Dobi no-remapping) and plain state dicts ------------------------------

def _import_pickled(src: str | Path, out: str | Path, family: str, layout: _Layout, trust_pickle: bool,
                    config: ConfigArg) -> Path:
    src, out = Path(src), Path(out)
    _check_out(out)
    files = _source_files(src)
    obj = _load_any(files, trust_pickle)
    tensors, pickled_cfg, kind, root = _unpack(obj, files[0])
    here = src if src.is_dir() else src.parent
    cfg, cfg_from = _resolve_config(config, pickled_cfg, here, files[0])
    t = _strip(tensors)
    _check_layers(cfg, t, files[0])
    shapes = cfg.linear_shapes()
    factors: dict[str, Any] = {}
    used: list[torch.Tensor] = []
    densified: list[str] = []
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            name, blk, (out_f, in_f) = proj_name(i, p), _block(i, p), shapes[p]
            k_v, k_u = f"{blk}{layout.first.format(p=p)}.weight", f"{blk}{layout.second.format(p=p)}.weight"
            k_dense = f"{blk}{layout.dense.format(p=p)}.weight" if layout.dense else None
            if k_v not in t and k_u not in t and k_dense in t:  # a module the method left dense
                factors[name] = _dense(t, k_dense, out_f, in_f, _family_hint(t, i, family))
                used.append(factors[name])
                continue
            U, V = _factor_pair(t, name, k_v, k_u, out_f, in_f, family)
            used += [U, V]
            factors[name] = _settle(name, U, V, out_f, in_f, densified)
    if all(isinstance(f, torch.Tensor) for n, f in factors.items() if n not in densified):
        raise CheckpointError(f"{files[0]}: every projection is a plain dense Linear, not {family} factors; "
                              "import a dense model with --family hf")
    common, used_common = _common(cfg, t, files[0])
    model, store = _build(cfg, common, factors, {}, used + used_common)
    prov = dict(importer=family, layout=kind, config_from=cfg_from, sha256=_sha256(files))
    if root:
        prov["pickled_class"] = root
    return _save(out, model, family, src, prov, _dtypes(used + used_common), store, densified,
                 tokenizer_dir=_tokenizer_dir(here))


def _source_files(src: Path) -> list[Path]:
    """The weight file(s) of a pickle-family source: one .pt, or safetensors / pytorch_model*.bin shards."""
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise CheckpointError(f"{src} does not exist")
    pts = sorted(src.glob("*.pt"))
    if len(pts) > 1:
        raise CheckpointError(f"{src} holds several .pt files {[p.name for p in pts]}; pass the one to import")
    files = pts or sorted(src.glob("*.safetensors")) or sorted(src.glob("pytorch_model*.bin"))
    if not files:
        raise CheckpointError(f"{src} holds no .pt, .safetensors or pytorch_model*.bin file")
    return files


def _load_any(files: list[Path], trust_pickle: bool) -> Any:
    """One file: whatever it holds. Several (shards): their state dicts merged."""
    if len(files) == 1:
        return _load_one(files[0], trust_pickle)
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        part = _load_one(f, trust_pickle)
        if not isinstance(part, dict):
            raise CheckpointError(f"{f} is a shard but not a state dict of tensors")
        merged.update(part)
    return merged


def _load_one(path: Path, trust_pickle: bool) -> Any:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return load_torch_pickle(path, trust_pickle)


def _unpack(obj: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict | None, str, str | None]:
    """(flat tensors, pickled HF config as a dict or None, layout name, pickled model class or None)."""
    if isinstance(obj, dict) and "model" in obj:  # torch.save({'model': model, 'tokenizer': tok})
        obj = obj["model"]
    elif isinstance(obj, dict) and "state_dict" in obj:
        obj = obj["state_dict"]
    if isinstance(obj, dict):
        tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        if not tensors:
            raise CheckpointError(f"{path}: unknown layout: a dict without tensors (keys {list(obj)[:4]})")
        return tensors, None, "state-dict", None
    if isinstance(stub_attrs(obj).get("_modules"), dict):  # a pickled nn.Module tree (stubs, or real if trusted)
        root = obj.stub_name if isinstance(obj, Stub) else f"{type(obj).__module__}.{type(obj).__qualname__}"
        cfg = stub_attrs(obj).get("config")
        cfg_dict = stub_attrs(cfg) if cfg is not None else None
        return stub_tensors(obj), (cfg_dict or None), "pickled-model", root
    raise CheckpointError(f"{path}: unknown layout: expected a pickled model, {{'model': model, ...}} or a state "
                          f"dict of tensors, found {getattr(obj, 'stub_name', type(obj).__name__)}")


# --- Dobi-SVD remapping layout ------------------------------------------------------------------------

def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic quantization map (`create_dynamic_map()`), (256,) fp32 sorted.

    Dobi-SVD's remapping stores each factor column as indices into this map times a per-column absmax.
    """
    data: list[float] = []
    for i in range(7):  # exponent 10^(i-6); the fraction gets 2^i midpoints of linspace(0.1, 1)
        b = torch.linspace(0.1, 1, 2 ** i + 1)
        means = ((b[:-1] + b[1:]) / 2.0) * 10 ** (-6 + i)
        data += means.tolist() + (-means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def _import_dobi_remap(src: Path, out: Path, trust_pickle: bool, config: ConfigArg) -> Path:
    _check_out(out)
    if config is None:
        cfg, _ = read_hf_config(src)
        cfg_from = "config.json"
    else:
        cfg, cfg_from = _config_arg(config)
    base = _strip(read_hf_tensors(src, trust_pickle))  # embeddings, norms, lm_head only
    remap_path = src / "remapping_weight.pt"
    remap = load_torch_file(remap_path, trust_pickle)
    if not isinstance(remap, dict):
        raise CheckpointError(f"{remap_path} is not a dict of per-module factors")
    code = dynamic_map()
    shapes = cfg.linear_shapes()
    factors: dict[str, Any] = {}
    used: list[torch.Tensor] = []
    densified: list[str] = []
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            name, (out_f, in_f) = proj_name(i, p), shapes[p]
            key = f"model.{_block(i, p)}{p}_proj"
            if key not in remap:
                raise CheckpointError(f"{remap_path} lacks the entry {key!r}")
            U, V = _dequantize(remap[key], code, f"{remap_path.name}[{key!r}]")
            t = {f"{key[6:]}.us": U, f"{key[6:]}.vt": V}  # shape checks name them model.layers.{i}....us / .vt
            U, V = _factor_pair(t, name, f"{key[6:]}.vt", f"{key[6:]}.us", out_f, in_f, "dobi-svd")
            used += [U, V]
            factors[name] = _settle(name, U, V, out_f, in_f, densified)
    extra = sorted(k for k in remap if isinstance(k, str) and re.match(r"model\.layers\.(\d+)\.", k)
                   and int(k.split(".")[2]) >= cfg.num_hidden_layers)
    if extra:
        raise CheckpointError(f"{remap_path} has entry {extra[0]!r} beyond the config's "
                              f"{cfg.num_hidden_layers} layers")
    common, used_common = _common(cfg, base, src)
    model, store = _build(cfg, common, factors, {}, used + used_common)
    files = sorted(src.glob("pytorch_model*.bin")) + sorted(src.glob("*.safetensors")) + [remap_path]
    prov = dict(importer="dobi-svd", layout="remapping", config_from=cfg_from, sha256=_sha256(files))
    return _save(out, model, "dobi-svd", src, prov, _dtypes(used + used_common), store, densified,
                 tokenizer_dir=_tokenizer_dir(src))


def _dequantize(entry: Any, code: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One remapping entry -> (U [out, k], V [k, in]) fp16, as Dobi-SVD's DOBI_dequantize computes them."""
    need = ("us_quan", "vt_quan", "us_absmax", "vt_absmax", "tuple_info")
    if not isinstance(entry, dict) or any(k not in entry for k in need):
        raise CheckpointError(f"{where} is not a remapping entry with {', '.join(need)}")
    us_q, vt_q, us_a, vt_a, tail = (entry[k] for k in need)
    for n, q in (("us_quan", us_q), ("vt_quan", vt_q)):
        if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.ndim != 2:
            raise CheckpointError(f"{where}: {n} must be a 2-d uint8 tensor of map indices")
    for n, a in (("us_absmax", us_a), ("vt_absmax", vt_a)):
        if not isinstance(a, torch.Tensor) or not a.is_floating_point():
            raise CheckpointError(f"{where}: {n} must be a float tensor")
    k = us_q.shape[0]
    us_a, vt_a = us_a.float().reshape(-1), vt_a.float().reshape(-1)
    if vt_q.shape[0] != k or us_a.numel() != k or vt_a.numel() != k:
        raise CheckpointError(f"{where}: us_quan {list(us_q.shape)}, vt_quan {list(vt_q.shape)}, absmax "
                              f"{us_a.numel()}/{vt_a.numel()} disagree on the rank")
    U = code[us_q.long()].T * us_a  # (m, k): column j scaled by its absmax
    V = vt_a[:, None] * code[vt_q.long()]  # (k, n)
    if tail is not None:  # the unquantized rows of U (out > in) or columns of V (in > out)
        if not (isinstance(tail, (tuple, list)) and len(tail) == 2 and tail[0] in ("us", "vt")
                and isinstance(tail[1], torch.Tensor)):
            raise CheckpointError(f"{where}: tuple_info must be None or ('us' | 'vt', tensor)")
        side, rest = tail[0], tail[1].float()
        try:
            U, V = (torch.cat([U, rest], 0), V) if side == "us" else (U, torch.cat([V, rest], 1))
        except RuntimeError:
            raise CheckpointError(f"{where}: tuple_info tail {list(rest.shape)} does not fit "
                                  f"U {list(U.shape)} / V {list(V.shape)}") from None
    return U.half(), V.half()


# --- shared helpers ------------------------------------------------------------------------------

def _check_out(out: Path) -> None:
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose another output path or remove it first")


def _block(i: int, p: str) -> str:
    return f"layers.{i}.{'self_attn' if p in ATTN_PROJS else 'mlp'}."


def _strip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without the `model.` prefix of LlamaForCausalLM (`lm_head.weight` has none)."""
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def _check_layers(cfg: ModelConfig, t: dict[str, torch.Tensor], where: Path) -> None:
    for k in t:
        m = re.match(r"layers\.(\d+)\.", k)
        if m and int(m[1]) >= cfg.num_hidden_layers:
            raise CheckpointError(f"{where}: tensor model.{k} is beyond the config's {cfg.num_hidden_layers} "
                                  "layers (wrong config?)")


def _factor_pair(t: dict[str, torch.Tensor], name: str, k_first: str, k_second: str, out_f: int, in_f: int,
                 family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [out, r], V [r, in]) of one projection, oriented by shape; `k_first` is applied first (V by name)."""
    missing = [k for k in (k_first, k_second) if k not in t]
    if missing:
        layer, p = int(name.split(".")[1]), name.rsplit(".", 1)[1]
        near = sorted(k for k in t if k.startswith(f"{_block(layer, p)}{p}_"))[:3]
        raise CheckpointError(f"no {family} factor model.{missing[0]} for {name}"
                              + (f" (found {', '.join('model.' + k for k in near)})" if near else "")
                              + _family_hint(t, layer, family))
    a, b = t[k_first], t[k_second]
    for k in (k_first, k_second):
        _check_no_bias(t, k)
        if t[k].ndim != 2 or not t[k].is_floating_point():
            raise CheckpointError(f"tensor model.{k} must be a 2-d float matrix, got {list(t[k].shape)} {t[k].dtype}")

    def fits(U: torch.Tensor, V: torch.Tensor) -> bool:
        return U.shape[0] == out_f and V.shape[1] == in_f and U.shape[1] == V.shape[0]

    if fits(b, a):  # the family's order; when out == in == r both fit and this order wins
        U, V = b, a
    elif fits(a, b):  # the names lie about the order (A/B letters, §0.1): trust the shapes
        U, V = a, b
    else:
        raise CheckpointError(f"{name}: tensors model.{k_first} {list(a.shape)} and model.{k_second} "
                              f"{list(b.shape)} do not factor a [{out_f}, {in_f}] matrix as [out, r] x [r, in]")
    if V.shape[0] > min(out_f, in_f):
        raise CheckpointError(f"{name}: tensor model.{k_first if V is a else k_second} has rank {V.shape[0]}, above "
                              f"min(out, in) = {min(out_f, in_f)}")
    return U, V


def _family_hint(t: dict[str, torch.Tensor], layer: int, family: str) -> str:
    for other, lay in LAYOUTS.items():
        if other != family.removesuffix("-v2") and f"{_block(layer, 'q')}{lay.first.format(p='q')}.weight" in t:
            return f"; it looks like a {other} checkpoint (--family {other})"
    return ""


def _check_no_bias(t: dict[str, torch.Tensor], weight_key: str) -> None:
    bias = t.get(weight_key.removesuffix(".weight") + ".bias")
    if bias is not None and bool(bias.ne(0).any()):
        raise CheckpointError(f"tensor model.{weight_key.removesuffix('.weight')}.bias is non-zero; rankserve's "
                              "LLaMA projections have no bias")


def _dense(t: dict[str, torch.Tensor], key: str, out_f: int, in_f: int, hint: str = "") -> torch.Tensor:
    if key not in t:
        raise CheckpointError(f"the source lacks tensor model.{key}{hint}")
    _check_no_bias(t, key)
    if tuple(t[key].shape) != (out_f, in_f) or not t[key].is_floating_point():
        raise CheckpointError(f"tensor model.{key} has shape {list(t[key].shape)} {t[key].dtype}, expected "
                              f"[{out_f}, {in_f}] float{hint}")
    return t[key]


def _settle(name: str, U: torch.Tensor, V: torch.Tensor, out_f: int, in_f: int, densified: list[str]) -> Any:
    """Keep (U, V), or the dense U @ V when the factors are no smaller than the matrix."""
    r = V.shape[0]
    if r * (out_f + in_f) < out_f * in_f:
        return U, V
    densified.append(name)
    return U.float() @ V.float()


def _share_groups(raw: dict, p: str, n_layers: int) -> list[list[int]]:
    groups = raw.get(f"{p}_groups")
    if groups is None:
        return [[i] for i in range(n_layers)]  # private: one basis per layer
    ok = isinstance(groups, list) and all(isinstance(g, list) and g and all(isinstance(i, int) for i in g)
                                          for g in groups)
    flat = sorted(i for g in groups for i in g) if ok else []
    if not ok or flat != list(range(n_layers)):
        raise CheckpointError(f"config.json {p}_groups {groups} must cover layers 0..{n_layers - 1} exactly once")
    return groups


def _group_name(p: str, layers: list[int]) -> str:
    """`q.0-1` for consecutive layers, `q.0+2+5` otherwise."""
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{p}.{layers[0]}-{layers[-1]}"
    return f"{p}." + "+".join(map(str, layers))


def _common(cfg: ModelConfig, t: dict[str, torch.Tensor], where: Path) -> tuple[dict[str, torch.Tensor], list]:
    """Embeddings, norms and head under native names, every shape checked."""
    h, v = cfg.hidden_size, cfg.vocab_size
    expected = {"embed.weight": (v, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (v, h)
    for i in range(cfg.num_hidden_layers):
        expected[f"layers.{i}.attn_norm.weight"] = (h,)
        expected[f"layers.{i}.mlp_norm.weight"] = (h,)
    found = {}
    for k, x in t.items():
        n = hf_common_name(k)
        if n in expected:
            found[n] = (k, x)
    out = {}
    for n, shape in expected.items():
        if n not in found:
            raise CheckpointError(f"{where}: the source lacks tensor {_hf_name(n)}")
        k, x = found[n]
        if tuple(x.shape) != shape or not x.is_floating_point():
            raise CheckpointError(f"tensor {k} has shape {list(x.shape)} {x.dtype}, expected {list(shape)} float")
        out[n] = x
    return out, list(out.values())


def _hf_name(native: str) -> str:
    """HF name of a native embedding / norm / head tensor, for error messages."""
    m = re.fullmatch(r"layers\.(\d+)\.(attn|mlp)_norm\.weight", native)
    if m:
        return f"model.layers.{m[1]}.{'input_layernorm' if m[2] == 'attn' else 'post_attention_layernorm'}.weight"
    return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(native, native)


def _store_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    kinds = {x.dtype for x in tensors}
    return kinds.pop() if len(kinds) == 1 else torch.float32  # mixed: the lossless common type


def _dtypes(tensors: list[torch.Tensor]) -> list[str]:
    return sorted({str(x.dtype).removeprefix("torch.") for x in tensors})


def _build(cfg: ModelConfig, common: dict[str, torch.Tensor], factors: dict[str, Any],
           groups: dict[str, tuple[list[str], torch.Tensor]],
           used: list[torch.Tensor]) -> tuple[Transformer, torch.dtype]:
    """A `Transformer` holding exactly the imported tensors; group members share one V Parameter."""
    dtype = _store_dtype(used)
    ranks = {n: (None if isinstance(f, torch.Tensor) else int(f[1].shape[0])) for n, f in factors.items()}
    with torch.device("meta"):  # no random init: every parameter is overwritten below
        model = Transformer(cfg, ranks, {g: members for g, (members, _) in groups.items()}, dtype=dtype)
    model = model.to_empty(device="cpu")
    params = dict(model.named_parameters(remove_duplicate=False))
    grouped = {m for members, _ in groups.values() for m in members}
    filled = set()
    with torch.no_grad():
        for n, x in common.items():
            params[n].copy_(x)
            filled.add(n)
        for name, f in factors.items():
            if isinstance(f, torch.Tensor):
                params[f"{name}.weight"].copy_(f)
                filled.add(f"{name}.weight")
                continue
            params[f"{name}.U"].copy_(f[0])
            filled.add(f"{name}.U")
            if name not in grouped:
                params[f"{name}.V"].copy_(f[1])
                filled.add(f"{name}.V")
        for g, (members, V) in groups.items():
            base = model.bases[_group_key(g)]
            base.copy_(V)
            filled.update([f"bases.{_group_key(g)}"] + [f"{m}.V" for m in members])
            layers = model.projections()
            assert all(layers[m].V is base for m in members), "group members must hold one Parameter"
    missing = sorted(set(params) - filled)
    assert not missing, f"importer left parameters unset: {missing[:3]}"  # a bug here, not bad input
    return model, dtype


def _rank_uniformity(model: Transformer) -> dict[str, list[bool]]:
    """Per layer: Rq == Rk == Rv, Rgate == Rup (the fused fast paths need them; §1.2)."""
    r = {name: layer.rank for name, layer in model.projections().items()}
    layers = range(model.cfg.num_hidden_layers)
    return {"qkv": [r[proj_name(i, "q")] == r[proj_name(i, "k")] == r[proj_name(i, "v")] for i in layers],
            "gate_up": [r[proj_name(i, "gate")] == r[proj_name(i, "up")] for i in layers]}


def _tokenizer_dir(d: Path) -> Path | None:
    return d if any((d / n).is_file() for n in ("tokenizer.model", "tokenizer.json")) else None


def _sha256(files: list[Path]) -> dict[str, str]:
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        out[f.name] = h.hexdigest()
    return out


def _save(out: Path, model: Transformer, family: str, src: Path, prov: dict[str, Any], dtypes: list[str],
          store: torch.dtype, densified: list[str], tokenizer_dir: Path | None) -> Path:
    prov.update(dtypes_found=dtypes, stored_dtype=str(store).removeprefix("torch."),
                rank_uniform=_rank_uniformity(model), densified=densified)
    if tokenizer_dir is None:
        prov["tokenizer"] = ("none: no tokenizer.model / tokenizer.json beside the source "
                             "(a pickled tokenizer is never used)")
    else:
        prov["tokenizer"] = "copied from beside the source"
    manifest = Manifest(family=family, ranks={}, source=src.name, provenance=prov)
    return save_checkpoint(out, model, manifest, tokenizer_dir=tokenizer_dir)


def _config_arg(config: Any) -> tuple[ModelConfig, str]:
    if isinstance(config, ModelConfig):
        return config, "argument"
    if isinstance(config, dict):
        d, label = config, "argument"
    else:
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise CheckpointError(f"config {p} does not exist")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: not valid JSON ({e})") from None
        label = f"argument ({p.name})"
    try:
        return ModelConfig.from_hf(d), label
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"config {label}: {e}") from None


def _resolve_config(config: Any, pickled: dict | None, here: Path, src: Path) -> tuple[ModelConfig, str]:
    """The explicit argument, else the config pickled with the model, else a config.json beside the source."""
    if config is not None:
        return _config_arg(config)
    if pickled is not None:
        try:
            return ModelConfig.from_hf(pickled), "pickle"
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{src}: the pickled model config is unusable ({e}); pass a config.json") from None
    if (here / "config.json").is_file():
        return read_hf_config(here)[0], "config.json"
    raise CheckpointError(f"{src}: no model config: the file holds none and there is no config.json beside it")


def _import_llama2c(src: str | Path, out: str | Path, trust_pickle: bool = False) -> Path:
    return import_llama2c(src, out)  # llama2.c files hold no pickles: the flag has nothing to allow


# `rankserve import --family F SRC OUT` calls IMPORTERS[F](src, out, trust_pickle=flag).
IMPORTERS: dict[str, Callable[..., Path]] = {
    "hf": import_hf,
    "llama2c": _import_llama2c,
    "svd-llm": import_svdllm,
    "svd-llm-v2": import_svdllm_v2,
    "dobi-svd": import_dobi,
    "basis-sharing": import_basis_sharing,
}
