"""Importers of dense LLaMA checkpoints: an HF directory (safetensors or .bin) and llama2.c "version 0" files.

Both end in `save_checkpoint` with every projection dense (rank None); `rankserve compress` factorizes later.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np
import torch

from rankserve.compress.safe_load import load_torch_file
from rankserve.workers.checkpoint import CheckpointError, Manifest, save_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import PROJS, Transformer, proj_name

HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def hf_common_name(key: str) -> str | None:
    """Native name of an HF LLaMA non-projection tensor (embeddings, norms, head), else None."""
    key = key.removeprefix("model.")
    if key == "embed_tokens.weight":
        return "embed.weight"
    if key in ("norm.weight", "lm_head.weight"):
        return key
    m = re.fullmatch(r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", key)
    if m:
        return f"layers.{m[1]}.{'attn_norm' if m[2] == 'input_layernorm' else 'mlp_norm'}.weight"
    return None


def read_hf_config(src: Path) -> tuple[ModelConfig, dict]:
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} lacks config.json (an HF model directory is expected)")
    try:
        raw = json.loads((src / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"must hold a JSON object, not a {type(raw).__name__}")
        return ModelConfig.from_hf(raw), raw
    except (json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{src / 'config.json'}: {e}") from None
    except TypeError as e:  # a field of the wrong type: "hidden_size": [32], "rope_scaling": 3
        raise CheckpointError(f"{src / 'config.json'}: a field has the wrong type ({e})") from None


def read_hf_tensors(src: Path, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory: model.safetensors, sharded safetensors, or pytorch_model*.bin. Where an index
    (model.safetensors.index.json, pytorch_model.bin.index.json) names the shards, only those are read: a repository
    may also ship the same weights in another layout (Mistral's consolidated.safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = _indexed_shards(src, "model.safetensors.index.json") or sorted(src.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                out.update(load_file(str(f)))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
        return out
    bins = _indexed_shards(src, "pytorch_model.bin.index.json") or sorted(src.glob("pytorch_model*.bin"))
    if not bins:
        raise CheckpointError(f"{src} holds no *.safetensors or pytorch_model*.bin weights")
    out = {}
    for f in bins:
        sd = load_torch_file(f, trust_pickle=trust_pickle)
        if not isinstance(sd, dict):
            raise CheckpointError(f"{f} is not a state dict")
        out.update({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    return out


def _indexed_shards(src: Path, index: str) -> list[Path]:
    """The shard files an HF index names (its weight_map's values), each checked to exist; [] without an index."""
    if not (src / index).is_file():
        return []
    try:
        weight_map = json.loads((src / index).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{src / index} is not a shard index (a weight_map of tensor -> file): {e}") from None
    shards = [src / n for n in names]
    for f in shards:
        if f.parent != src or not f.is_file():
            raise CheckpointError(f"{src / index} names {f.name}, which is not a file in {src}")
    return shards


def dense_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Transformer:
    """Build an all-dense `Transformer` (fp32) from native-named tensors, checking every shape."""
    model = Transformer(cfg, {}, {})
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors]
    if missing:
        raise CheckpointError(f"the source lacks tensor {missing[0]} (and {len(missing) - 1} more)" if len(missing) > 1
                              else f"the source lacks tensor {missing[0]}")
    with torch.no_grad():
        for n, p in params.items():
            t = tensors[n]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"tensor {n} has shape {list(t.shape)}, expected {list(p.shape)}")
            if not t.is_floating_point():  # int8 codes of a quantized export would be cast into garbage
                raise CheckpointError(f"tensor {n} is {str(t.dtype).removeprefix('torch.')}, not a float weight "
                                      "(a quantized checkpoint? import its float weights)")
            p.copy_(t.float())
    return model


def import_hf(src: str | Path, out: str | Path, trust_pickle: bool = False) -> Path:
    """Dense HF LLaMA directory -> native checkpoint (all projections dense)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory (an HF model directory is expected)")
    cfg, raw = read_hf_config(src)
    if raw.get("model_type", "llama") not in ("llama", "mistral"):
        raise CheckpointError(f"{src}: model_type {raw.get('model_type')!r} is not a LLaMA model")
    hf = read_hf_tensors(src, trust_pickle)
    native: dict[str, torch.Tensor] = {}
    for k, t in hf.items():
        name = hf_common_name(k)
        if name is not None:
            native[name] = t
            continue
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)", k)
        if m and m[3] in PROJS and m[4] == "weight":
            native[f"{proj_name(int(m[1]), m[3])}.weight"] = t
        elif m and m[3] in PROJS and bool(t.ne(0).any()):  # dropping it would change every output
            raise CheckpointError(f"{src}: tensor {k} is a non-zero bias; rankserve's LLaMA projections have none "
                                  "(attention_bias / mlp_bias models are not supported)")
    if cfg.tie_word_embeddings:
        native.pop("lm_head.weight", None)
    model = dense_model(cfg, native)
    dtypes = {t.dtype for t in native.values() if t.is_floating_point()}
    store = dtypes.pop() if len(dtypes) == 1 else torch.float32  # keep the source's precision on disk
    manifest = Manifest(family="dense", ranks={}, source=src.name, provenance={"importer": "hf", "dtype": str(store)})
    return save_checkpoint(out, model, manifest, tokenizer_dir=src, dtype=store)


def import_llama2c(src: str | Path, out: str | Path) -> Path:
    """llama2.c "version 0" checkpoint (+ its SentencePiece tokenizer beside it) -> native checkpoint.

    `src` is the .bin file or a directory holding one model .bin and a `tok*.model`/`tokenizer.model`.
    llama2.c rotates interleaved pairs; we permute wq/wk rows per head to the rotate_half layout.
    """
    src = Path(src)
    if src.is_dir():
        bins = [p for p in sorted(src.glob("*.bin")) if not p.name.startswith("tok")]
        if len(bins) != 1:
            raise CheckpointError(f"{src}: expected exactly one llama2.c model .bin, found {[p.name for p in bins]}")
        path, tok_dir = bins[0], src
    elif src.is_file():
        path, tok_dir = src, src.parent
    else:
        raise CheckpointError(f"{src} does not exist")
    tok_models = [tok_dir / "tokenizer.model"] + sorted(tok_dir.glob("tok*.model"))
    tok_model = next((p for p in tok_models if p.is_file()), None)
    if tok_model is None:
        raise CheckpointError(f"{tok_dir} has no SentencePiece tokenizer (tokenizer.model or tok*.model)")
    raw = path.read_bytes()
    if len(raw) < 28:
        raise CheckpointError(f"{path} is too short to be a llama2.c checkpoint")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv:
        raise CheckpointError(f"{path}: header {(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len)} is not a valid "
                              "llama2.c version-0 header")
    hd = dim // n_heads
    kv_dim = n_kv * hd
    sizes = [("embed", (vocab, dim)), ("rms_att", (n_layers, dim)), ("wq", (n_layers, dim, dim)),
             ("wk", (n_layers, kv_dim, dim)), ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
             ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)),
             ("w3", (n_layers, hidden, dim)), ("rms_final", (dim,)), ("freq_real", (seq_len, hd // 2)),
             ("freq_imag", (seq_len, hd // 2))]
    if not shared:
        sizes.append(("wcls", (vocab, dim)))
    need = sum(int(np.prod(s)) for _, s in sizes) * 4
    if len(raw) - 28 != need:
        raise CheckpointError(f"{path}: expected {need} bytes of float32 weights after the header, found {len(raw) - 28}")
    flat = np.frombuffer(raw, dtype=np.float32, offset=28)
    w, at = {}, 0
    for name, shape in sizes:
        n = int(np.prod(shape))
        w[name] = torch.from_numpy(flat[at:at + n].copy()).view(shape)
        at += n

    def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:  # interleaved pairs -> rotate_half halves
        d_out, d_in = t.shape
        return t.view(heads, d_out // heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)

    cfg = ModelConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=n_layers,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv, max_position_embeddings=seq_len,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=shared, bos_token_id=1,
                      eos_token_id=[2, 1])  # llama2.c's models end a text with BOS (its run.c stops there), not EOS
    native = {"embed.weight": w["embed"], "norm.weight": w["rms_final"]}
    if not shared:
        native["lm_head.weight"] = w["wcls"]
    for i in range(n_layers):
        native[f"layers.{i}.attn_norm.weight"] = w["rms_att"][i]
        native[f"layers.{i}.mlp_norm.weight"] = w["rms_ffn"][i]
        per = {"q": unpermute(w["wq"][i], n_heads), "k": unpermute(w["wk"][i], n_kv), "v": w["wv"][i],
               "o": w["wo"][i], "gate": w["w1"][i], "down": w["w2"][i], "up": w["w3"][i]}
        for p, t in per.items():
            native[f"{proj_name(i, p)}.weight"] = t
    model = dense_model(cfg, native)
    manifest = Manifest(family="dense", ranks={}, source=path.name,
                        provenance={"importer": "llama2c", "sha256": hashlib.sha256(raw).hexdigest()})
    staging = {"tokenizer.model": tok_model.read_bytes()}
    return save_checkpoint(out, model, manifest, tokenizer_dir=None, extra_files=staging)
