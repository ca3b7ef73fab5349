"""The native checkpoint: a directory with config.json, rankserve.json, model.safetensors and tokenizer files.

Tensor names (U [out, r], V [r, in], y = U (V x)):
    embed.weight, norm.weight, lm_head.weight (absent when tied)
    layers.{i}.attn_norm.weight, layers.{i}.mlp_norm.weight
    layers.{i}.{attn|mlp}.{q,k,v,o,gate,up,down}.U / .V      factorized projection
    layers.{i}.{attn|mlp}.{proj}.weight                       dense projection
    bases.{group}.V                                          a shared basis, stored once; members store only U
rankserve.json: format_version, family, source, provenance, keep (achieved), kept_params, dense_params,
ranks {projection: rank | null}, groups {group: [projection, ...]}, methods {...}.

Writes go to a temporary sibling directory renamed into place when complete; no pickles are written.
Loading validates every shape, rank and group and names the offending tensor in its error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rankserve.workers.config import ModelConfig
from rankserve.workers.model import PROJS, Transformer, _group_key, proj_name

FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.bin", "generation_config.json", "chat_template.jinja")
NON_TENSOR_FILES = ("LICENSE", "LICENSE.txt", "README.md", "NOTICE")
# safetensors dtype codes a weight may be stored in; anything else (I8, U8, BOOL, ...) is not a float weight
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or inconsistent; the message says which file or tensor."""


@dataclass
class Manifest:
    family: str
    ranks: dict[str, int | None]
    groups: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)
    keep: float = 1.0  # achieved fraction of dense decoder-linear parameters kept (a shared basis counted once)
    kept_params: int = 0
    dense_params: int = 0
    methods: dict[str, Any] = field(default_factory=dict)  # PARSE routers, GSI bases, STAR-KV state
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return dict(format_version=self.format_version, family=self.family, source=self.source,
                    provenance=self.provenance, keep=self.keep, kept_params=self.kept_params,
                    dense_params=self.dense_params, ranks=self.ranks, groups=self.groups, methods=self.methods)

    @classmethod
    def from_json(cls, d: Any) -> "Manifest":
        if not isinstance(d, dict):
            raise CheckpointError(f"rankserve.json must hold a JSON object, not a {type(d).__name__}")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"rankserve.json format_version {d.get('format_version')!r} is not supported "
                                  f"(this rankserve reads version {FORMAT_VERSION})")
        for k in ("family", "ranks"):
            if k not in d:
                raise CheckpointError(f"rankserve.json lacks the field {k!r}")
        for k in ("ranks", "groups", "provenance", "methods"):  # the rest of the code walks these as dicts
            if not isinstance(d.get(k, {}), dict):
                raise CheckpointError(f"rankserve.json field {k!r} must be an object, not a {type(d[k]).__name__}")
        groups = d.get("groups", {})
        for g, members in groups.items():
            if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
                raise CheckpointError(f"rankserve.json group {g!r} must be a list of projection names, got {members!r}"[:300])
        return cls(family=d["family"], ranks=dict(d["ranks"]), groups={g: list(m) for g, m in groups.items()},
                   source=d.get("source", ""), provenance=d.get("provenance", {}), keep=float(d.get("keep", 1.0)),
                   kept_params=int(d.get("kept_params", 0)), dense_params=int(d.get("dense_params", 0)),
                   methods=d.get("methods", {}))


def count_params(cfg: ModelConfig, ranks: dict[str, int | None], groups: dict[str, list[str]]) -> tuple[int, int]:
    """(kept, dense) decoder-linear parameters; a shared basis counts once per group."""
    shapes = cfg.linear_shapes()
    grouped = {m for members in groups.values() for m in members}
    kept = 0
    for i in range(cfg.num_hidden_layers):
        for p in PROJS:
            name, (out, inp) = proj_name(i, p), shapes[p]
            r = ranks.get(name)
            if r is None:
                kept += out * inp
            else:
                kept += out * r + (0 if name in grouped else r * inp)
    for members in groups.values():
        proj = members[0].rsplit(".", 1)[1]
        kept += ranks[members[0]] * shapes[proj][1]
    return kept, cfg.dense_linear_params()


def model_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors to store for `model`, each shared basis once under `bases.{group}.V`."""
    grouped = {m for members in model.groups.values() for m in members}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.startswith("bases."):
            continue
        if name.endswith(".V") and name[:-2] in grouped:
            continue
        out[name] = t
    for g in model.groups:
        out[f"bases.{g}.V"] = model.bases[_group_key(g)].data
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an output path that exists or cannot be created, before any long work is done for it."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} already exists; choose another output path or remove it first")
    parent = next((p for p in out_dir.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise CheckpointError(f"cannot create {out_dir}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot create {out_dir}: {parent} is not writable")
    return out_dir


def save_checkpoint(out_dir: str | Path, model: Transformer, manifest: Manifest,
                    tokenizer_dir: str | Path | None = None, extra_files: dict[str, bytes] | None = None,
                    dtype: torch.dtype | None = None, overwrite: bool = False,
                    method_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a native checkpoint atomically: a temp dir next to `out_dir`, renamed into place when complete.

    A write that fails (no space, a file in the way) raises `CheckpointError` and leaves nothing behind.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; choose another output path or remove it first")
    cfg = model.cfg
    manifest.ranks = {n: (None if l.rank is None else int(l.rank)) for n, l in model.projections().items()}
    manifest.groups = model.groups
    manifest.kept_params, manifest.dense_params = count_params(cfg, manifest.ranks, manifest.groups)
    manifest.keep = round(manifest.kept_params / manifest.dense_params, 6)
    tensors = model_tensors(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    for k, v in (method_tensors or {}).items():  # e.g. "parse.layers.0.attn.q.router" -> methods.parse....
        tensors[f"methods.{k}"] = v.detach().contiguous().cpu()
    # Named before it exists, so an interrupt (Ctrl-C, SIGTERM) landing just after the mkdir finds it to remove.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale(out_dir)
        tmp.mkdir(mode=0o700)
        hf = cfg.to_hf()
        hf["torch_dtype"] = str(tensors["embed.weight"].dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / "rankserve.json").write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "rankserve"})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES + NON_TENSOR_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copyfile(src, tmp / name)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o755)  # private while written; a checkpoint is an ordinary readable directory
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
            _fsync(f)  # on the disk before the rename: after a crash the name must not outlive the data
        _fsync(tmp)
        if out_dir.exists():  # overwrite: swap the old one out only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
        _fsync(out_dir.parent)  # the rename itself
    except (OSError, SafetensorError) as e:  # disk full, a file where a directory goes, ...
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write {out_dir}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _fsync(path: Path) -> None:
    """Flush a file's data to the disk; a directory's entries where the platform can (some file systems and Windows
    refuse to open or sync a directory: that is no failure of the save)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


STALE_TMP_S = 3600  # a temp dir untouched this long is a killed writer's (a save writes its files in seconds)


def _sweep_stale(out_dir: Path) -> None:
    """Remove temp dirs of earlier saves to `out_dir` that were killed before their cleanup could run."""
    now, prefix = time.time(), f".{out_dir.name}.tmp-"
    for p in out_dir.parent.iterdir():
        if not p.name.startswith(prefix) or p.is_symlink() or not p.is_dir():
            continue
        try:  # a live writer touches the file it is writing: the newest mtime inside counts
            touched = max([p.stat().st_mtime] + [f.stat().st_mtime for f in p.iterdir()])
        except OSError:  # gone meanwhile, or not ours to read: leave it
            continue
        if now - touched > STALE_TMP_S:
            shutil.rmtree(p, ignore_errors=True)


def read_config(path: str | Path) -> tuple[ModelConfig, Manifest]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (a native rankserve checkpoint is a directory)")
    for name in ("config.json", "rankserve.json", "model.safetensors"):
        if not (path / name).is_file():
            hint = " (a dense HF or foreign checkpoint? convert it with `rankserve import`)" if name == "rankserve.json" else ""
            raise CheckpointError(f"{path} lacks {name}{hint}")
    try:
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        manifest = Manifest.from_json(json.loads((path / "rankserve.json").read_text()))
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return cfg, manifest


def _validate(cfg: ModelConfig, manifest: Manifest, shapes_on_disk: dict[str, tuple[int, ...]],
              dtypes_on_disk: dict[str, str]) -> None:
    shapes = cfg.linear_shapes()
    expected: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, cfg.hidden_size), "norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    grouped: dict[str, str] = {}
    keys: dict[str, str] = {}  # the model holds a basis under its name with '.' read as '_' (_group_key)
    for g, members in manifest.groups.items():
        if not members:
            raise CheckpointError(f"group {g!r} has no members")
        if not g:
            raise CheckpointError("rankserve.json has a group with an empty name")
        if _group_key(g) in keys:
            raise CheckpointError(f"group names {keys[_group_key(g)]!r} and {g!r} collide ('.' and '_' count as one "
                                  "character in a basis name); rename one")
        keys[_group_key(g)] = g
        projs = {m.rsplit(".", 1)[-1] for m in members}
        if len(projs) != 1:
            raise CheckpointError(f"group {g!r} mixes projection types {sorted(projs)}; members must share an input size")
        rset = {manifest.ranks.get(m) for m in members}
        if len(rset) != 1 or None in rset:
            raise CheckpointError(f"group {g!r}: members must be factorized with one rank, got {sorted(map(str, rset))}")
        for m in members:
            if m in grouped:
                raise CheckpointError(f"{m} is in two groups ({grouped[m]!r} and {g!r})")
            grouped[m] = g
        expected[f"bases.{g}.V"] = (rset.pop(), shapes[projs.pop()][1])
    known = set()
    for i in range(cfg.num_hidden_layers):
        expected[f"layers.{i}.attn_norm.weight"] = (cfg.hidden_size,)
        expected[f"layers.{i}.mlp_norm.weight"] = (cfg.hidden_size,)
        for p in PROJS:
            name, (out, inp) = proj_name(i, p), shapes[p]
            known.add(name)
            if name not in manifest.ranks:
                raise CheckpointError(f"rankserve.json ranks lack {name}")
            r = manifest.ranks[name]
            if r is None:
                expected[f"{name}.weight"] = (out, inp)
                continue
            if not isinstance(r, int) or r <= 0:
                raise CheckpointError(f"{name}: rank must be a positive integer or null, got {r!r}")
            if r > min(out, inp):
                raise CheckpointError(f"{name}: rank {r} exceeds min(out, in) = {min(out, inp)}")
            expected[f"{name}.U"] = (out, r)
            if name not in grouped:
                expected[f"{name}.V"] = (r, inp)
    unknown = set(manifest.ranks) - known
    if unknown:
        raise CheckpointError(f"rankserve.json ranks name projections the config does not have: {sorted(unknown)[:3]}")
    for g, members in manifest.groups.items():
        for m in members:
            if m not in known:
                raise CheckpointError(f"group {g!r} names unknown projection {m}")
    for name, shape in expected.items():
        if name not in shapes_on_disk:
            raise CheckpointError(f"model.safetensors lacks tensor {name} (expected shape {list(shape)})")
        if tuple(shapes_on_disk[name]) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(shapes_on_disk[name])}, expected {list(shape)}")
        if dtypes_on_disk[name] not in FLOAT_DTYPES:  # a load would cast it silently (int8 codes, say) into garbage
            raise CheckpointError(f"tensor {name} has dtype {dtypes_on_disk[name]}, expected a float dtype "
                                  f"({', '.join(FLOAT_DTYPES)})")
    extra = set(shapes_on_disk) - set(expected)
    extra = {e for e in extra if not e.startswith("methods.")}  # method state (PARSE routers, ...) is checked by its owner
    if extra:
        raise CheckpointError(f"model.safetensors holds unexpected tensors, e.g. {sorted(extra)[:3]}")


def _open_weights(path: Path):
    try:
        return safe_open(str(path / "model.safetensors"), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises several types for a corrupt header
        raise CheckpointError(f"{path / 'model.safetensors'} is not a readable safetensors file: {e}") from None


def stored_params(path: str | Path) -> int:
    """Parameters of a native checkpoint's model as stored (a shared basis once, method state such as PARSE
    routers not counted), from the safetensors header: reads no weights."""
    with _open_weights(Path(path)) as f:
        return sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys() if not n.startswith("methods."))


def check_checkpoint(path: str | Path) -> tuple[ModelConfig, Manifest]:
    """A native checkpoint's config and manifest, validated against its weights' shapes (reads no weights)."""
    path = Path(path)
    cfg, manifest = read_config(path)
    with _open_weights(path) as f:
        _validate(cfg, manifest, {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()},
                  {n: f.get_slice(n).get_dtype() for n in f.keys()})
    return cfg, manifest


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[Transformer, Manifest]:
    """Load and validate a native checkpoint into a `Transformer` on `device` (dtype default: as stored)."""
    path = Path(path)
    cfg, manifest = read_config(path)
    with _open_weights(path) as f:
        names = list(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        _validate(cfg, manifest, shapes, {n: f.get_slice(n).get_dtype() for n in names})
        stored = FLOAT_DTYPES[f.get_slice("embed.weight").get_dtype()]
        dtype = dtype or (torch.float32 if stored == torch.float64 else stored)
        model = Transformer(cfg, manifest.ranks, manifest.groups, device=device, dtype=dtype)  # torch.empty: no init cost
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                if name.startswith("methods."):
                    continue
                t = f.get_tensor(name)
                target = params[f"bases.{_group_key(name[6:-2])}"] if name.startswith("bases.") else params[name]
                target.copy_(t.to(dtype))
    model.eval()
    return model, manifest


def read_method_tensors(path: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors stored under `methods.{prefix}.` (e.g. PARSE routers), without the prefix."""
    out = {}
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt", device="cpu") as f:
        for n in f.keys():
            if n.startswith(f"methods.{prefix}."):
                out[n[len(f"methods.{prefix}."):]] = f.get_tensor(n)
    return out
