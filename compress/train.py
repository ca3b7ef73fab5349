"""Train the reference LLaMA (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) on the tokenized corpus; save as HF.

Reads `--data` (from compress/bpe.py): train.bin, test.bin (WikiText-2 raw test, held out), val.bin,
tokenizer.json, manifest.json. Writes 8 files to `--out`: model.safetensors (bf16, HF key names), config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, train_log.json, loss.png, README.md (model card).

The step count comes from a wall-clock budget: time `timing_steps` steps after compilation, then fit the cosine
schedule into what is left of `--minutes` (counted from process start). `--max-steps` fixes it instead, for an
exact rerun of a logged run.

GPU:        python -m rankserve.compress.train --data .carry/reference --out $OUT --minutes 8
CPU smoke:  python -m rankserve.compress.train --data DIR --out DIR --preset tiny --device cpu --max-steps 10 \
                --batch-size 4 --seq-len 32 --no-compile --eval-windows 4 --final-eval-windows 8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from rankserve.compress.bpe import BOS_ID, EOS_ID, load_tokens, unigram_perplexity

SAMPLE_PROMPT = "The history of the"


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int = 2  # GQA: 3 query heads share each K/V head
    intermediate_size: int = 1024  # SwiGLU hidden, ~8/3 of dim
    max_seq_len: int = 512
    rope_theta: float = 10000.0  # the HF default, so old and new transformers read config.json alike
    norm_eps: float = 1e-5
    head_dim: int = field(init=False)

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim {self.dim} / n_heads {self.n_heads} / n_kv_heads {self.n_kv_heads} do not divide")
        self.head_dim = self.dim // self.n_heads


PRESETS = {
    "reference": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, intermediate_size=1024),  # 14.2M params
    "tiny": dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=128),  # CPU smoke tests
}


@dataclass
class TrainConfig:
    preset: str = "reference"
    seq_len: int = 512
    batch_size: int = 256  # sequences per step: 131k tokens
    lr: float = 2e-3  # peak; small models take a high rate
    min_lr_frac: float = 0.1  # cosine ends at lr * min_lr_frac
    warmup_steps: int = 150
    weight_decay: float = 0.1  # on matrices and the embedding, not on norms
    grad_clip: float = 1.0
    minutes: float = 8.0  # wall budget from process start to the last step; save and checks take ~20 s more
    max_steps: int | None = None  # fixes the step count (exact rerun); None: derived from `minutes`
    max_epochs: float | None = 12.0  # cap on passes over train.bin when the step count comes from `minutes`
    timing_steps: int = 20  # steps timed after compilation to set the step count
    timing_start: int = 5  # first steps carry compilation
    eval_every: int | None = None  # None: ~25 evaluations over the run
    eval_windows: int = 64  # held-out windows per evaluation during training
    final_eval_windows: int | None = None  # None: the whole test and val sets (smoke runs pass a few)
    log_every: int = 10
    seed: int = 0
    device: str = "cuda"
    compile: bool = True


# ---------------------------------------------------------------- model (module names = HF's, minus "model.")

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, D) cos and sin in HF's rotate_half layout: frequencies repeated over the two halves of a head."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (S, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    # x: (B, H, S, D); rotate_half pairs dimension i with i + D/2
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, S, D)
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, S, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # repeat K/V per query head (query head h reads kv head h // rep, as HF): keeps SDPA on the flash kernel
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, S, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LLaMA decoder; `state_dict()` keys prefixed with "model." are HF LlamaForCausalLM's (lm_head tied)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        cos, sin = rope_cos_sin(cfg, cfg.max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self):
        # GPT-2 init: N(0, 0.02), residual-stream outputs scaled by 1/sqrt(2 * n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers) if residual else 0.02)

    def forward(self, idx, targets=None):
        """idx: (B, S) token ids -> logits (B, S, V), or the mean loss if targets (B, S) are given."""
        S = idx.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]  # (S, D)
        x = self.embed_tokens(idx)  # (B, S, dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.norm(x), self.embed_tokens.weight)  # (B, S, V), tied lm_head
        if targets is None:
            return logits
        # inside forward so that torch.compile fuses the fp32 upcast into the loss
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (lm_head included) + causal attention scores and values."""
    per_layer = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.dim \
        + 3 * cfg.dim * cfg.intermediate_size
    matmul = cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim
    attn = cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * seq_len  # QK^T and PV, half the square (causal), x2 FLOPs
    return 6 * matmul + 3 * attn


# ---------------------------------------------------------------- HF directory

def save_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int = 15_000_000) -> None:
    """HF sharded safetensors (model-0000i-of-0000n.safetensors + index): the device returns files <= 16 MiB."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def save_hf(model: Llama, out_dir: Path, tokenizer_path: Path) -> None:
    """Write model.safetensors (bf16), config.json, generation_config.json, tokenizer.json, tokenizer_config.json."""
    cfg = model.cfg
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_sharded(tensors, out_dir)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": 0.02,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": None,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False, "max_length": cfg.max_seq_len}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.copyfile(tokenizer_path, out_dir / "tokenizer.json")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
               "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def load_hf(model_dir: Path, device: str = "cpu") -> Llama:
    """Read back a directory written by `save_hf` (fp32 weights)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = ModelConfig(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
                      n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
                      intermediate_size=c["intermediate_size"], max_seq_len=c["max_position_embeddings"],
                      rope_theta=c["rope_theta"], norm_eps=c["rms_norm_eps"])
    model = Llama(cfg)
    sd = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):  # one file or HF shards
        sd.update(load_file(f))
    model.load_state_dict({k.removeprefix("model."): v.float() for k, v in sd.items()})
    return model.to(device)


# ---------------------------------------------------------------- training

def lr_at(step: int, t: TrainConfig, total_steps: int | None) -> float:
    """Linear warmup, then cosine to lr * min_lr_frac at total_steps (peak lr until total_steps is known)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if total_steps is None:
        return t.lr
    frac = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
    return t.lr * (t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def get_batch(data: torch.Tensor, t: TrainConfig, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`; offsets drawn on data's device (no host sync) from the seeded generator `g`."""
    off = torch.randint(len(data) - t.seq_len - 1, (t.batch_size,), generator=g, device=data.device)  # (B,)
    idx = off[:, None] + torch.arange(t.seq_len + 1, device=data.device)  # (B, S+1)
    w = data[idx]
    return w[:, :-1], w[:, 1:]  # (B, S), (B, S)


@torch.no_grad()
def evaluate(model: Llama, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
             batch: int = 32) -> tuple[float, int]:
    """Mean next-token loss (nats) over non-overlapping windows of `tokens`; returns (loss, tokens scored)."""
    n = (len(tokens) - 1) // seq_len
    n = n if max_windows is None else min(n, max_windows)
    x = tokens[:n * seq_len].view(n, seq_len)  # (N, S)
    y = tokens[1:n * seq_len + 1].view(n, seq_len)  # (N, S)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=tokens.device, dtype=torch.float64)
    for i in range(0, n, batch):
        with _autocast(tokens.device):
            logits = model(x[i:i + batch])
        total += F.cross_entropy(logits.float().flatten(0, 1), y[i:i + batch].flatten(), reduction="sum").double()
    model.train(was_training)
    return total.item() / (n * seq_len), n * seq_len


@torch.no_grad()
def generate_greedy(model: Llama, ids: list[int], max_new_tokens: int = 48) -> list[int]:
    """Greedy continuation without a KV cache (re-runs the prefix: fine for a one-off sample)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    for _ in range(max_new_tokens):
        with _autocast(device):
            nxt = model(x[:, -model.cfg.max_seq_len:])[0, -1].argmax()
        x = torch.cat([x, nxt.view(1, 1)], dim=1)
        if nxt.item() == EOS_ID:
            break
    return x[0].tolist()


def train(data_dir: Path, out_dir: Path, t: TrainConfig, start_time: float | None = None) -> dict:
    """Train per `t` on `data_dir`, write the HF directory, log and plot to `out_dir`; return the log."""
    start_time = time.time() if start_time is None else start_time
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    for name in ("train.bin", "test.bin", "val.bin", "tokenizer.json", "manifest.json"):
        if not (data_dir / name).is_file():
            raise FileNotFoundError(f"{data_dir / name} is missing: run compress/corpus.py then compress/bpe.py, "
                                    f"and carry that folder to the device")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):  # checked before the training time
        raise FileExistsError(f"{out_dir} exists and is not empty; pass a new --out (nothing is overwritten)")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: pass --device cpu for a smoke run")
    torch.manual_seed(t.seed)
    np.random.seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device(t.device)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    manifest = json.loads((data_dir / "manifest.json").read_text())
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=t.seq_len, **PRESETS[t.preset])
    train_np, test_np, val_np = (load_tokens(data_dir / n) for n in ("train.bin", "test.bin", "val.bin"))
    train_data, test_data, val_data = (torch.from_numpy(a.astype(np.int64)).to(device)
                                       for a in (train_np, test_np, val_np))  # whole arrays on the device: ~130 MB

    model = Llama(cfg)
    model.init_weights()
    model.to(device)
    n_params = count_params(model)
    fpt = flops_per_token(cfg, t.seq_len)
    tokens_per_step = t.batch_size * t.seq_len
    print(f"model: {n_params:,} params ({n_params - cfg.vocab_size * cfg.dim:,} non-embedding), {cfg}")
    print(f"data: train {len(train_np):,} tokens, test {len(test_np):,}, val {len(val_np):,}; "
          f"{tokens_per_step:,} tokens/step; {fpt / 1e6:.1f} MFLOP/token")

    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    step_fn = torch.compile(model) if t.compile else model
    g = torch.Generator(device=device).manual_seed(t.seed)  # data order

    total_steps = t.max_steps
    eval_every = t.eval_every or (max(1, total_steps // 25) if total_steps else None)
    logs, evals = [], []
    loss_acc = torch.zeros((), device=device)
    n_acc, step, t_timing, compiled = 0, 0, None, t.compile
    test_loss, _ = evaluate(model, test_data, t.seq_len, t.eval_windows)
    evals.append({"step": 0, "tokens": 0, "test_loss": test_loss})
    t_train = time.time()
    while total_steps is None or step < total_steps:
        if total_steps is None and step == t.timing_start:
            _sync(device)
            t_timing = time.time()
        if total_steps is None and step == t.timing_start + t.timing_steps:
            _sync(device)
            step_time = (time.time() - t_timing) / t.timing_steps
            left = start_time + 60 * t.minutes - time.time()
            total_steps = step + max(0, int(0.97 * left / step_time))  # 3% for evaluations and logging
            if t.max_epochs:  # the corpus is small: past ~10 passes a 14M model memorizes more than it learns
                total_steps = min(total_steps, int(t.max_epochs * len(train_np) / tokens_per_step))
            eval_every = t.eval_every or max(1, total_steps // 25)
            print(f"timing: {step_time * 1e3:.1f} ms/step, {tokens_per_step / step_time / 1e6:.2f} M tokens/s, "
                  f"{fpt * tokens_per_step / step_time / 1e12:.0f} TFLOP/s; {left:.0f} s left -> {total_steps} steps "
                  f"({total_steps * tokens_per_step / 1e6:.0f} M tokens, "
                  f"{total_steps * tokens_per_step / len(train_np):.1f} epochs)")
            if total_steps <= step:
                break
        lr = lr_at(step, t, total_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, t, g)
        try:
            with _autocast(device):
                loss = step_fn(x, y)
            loss.backward()
        except Exception as e:  # torch.compile failures surface at the first call; train eagerly instead
            if not compiled or step > 0:
                raise
            print(f"torch.compile failed ({type(e).__name__}: {e}); falling back to eager")
            compiled, step_fn = False, model
            opt.zero_grad(set_to_none=True)
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += loss.detach()
        n_acc += 1
        step += 1
        if step % t.log_every == 0 or step == total_steps:
            train_loss = loss_acc.item() / n_acc
            loss_acc.zero_()
            n_acc = 0
            logs.append({"step": step, "tokens": step * tokens_per_step, "lr": lr, "train_loss": train_loss,
                         "time_s": time.time() - start_time})
            if step % (t.log_every * 10) == 0:
                print(f"step {step}/{total_steps or '?'} loss {train_loss:.4f} lr {lr:.2e} "
                      f"{time.time() - start_time:.0f}s")
        if eval_every and (step % eval_every == 0 or step == total_steps):
            test_loss, _ = evaluate(model, test_data, t.seq_len, t.eval_windows)
            val_loss, _ = evaluate(model, val_data, t.seq_len, t.eval_windows)
            evals.append({"step": step, "tokens": step * tokens_per_step, "test_loss": test_loss, "val_loss": val_loss})
    _sync(device)
    train_seconds = time.time() - t_train

    # score what is saved: bf16 weights
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    test_loss, n_scored = evaluate(model, test_data, t.seq_len, t.final_eval_windows)
    val_loss, _ = evaluate(model, val_data, t.seq_len, t.final_eval_windows)
    targets = test_np[1:n_scored + 1]  # the tokens the LM was scored on
    uni = unigram_perplexity(train_np, targets, cfg.vocab_size)
    uni_val = unigram_perplexity(val_np, targets, cfg.vocab_size)
    test_bytes = manifest["heldout"]["test"]["bytes"] * n_scored / (len(test_np) - 1)
    prompt_ids = tok.encode(SAMPLE_PROMPT).ids  # starts with <s>
    sample = tok.decode(generate_greedy(model, prompt_ids), skip_special_tokens=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))  # renamed to out_dir when complete
    try:
        save_hf(model, stage, data_dir / "tokenizer.json")
        hf_check = _check_with_transformers(model, stage, test_data[:t.seq_len])

        tail = [r["train_loss"] for r in logs[-5:]]
        final = {
            "steps": step, "tokens_seen": step * tokens_per_step, "epochs": step * tokens_per_step / len(train_np),
            "train_seconds": train_seconds, "tokens_per_s": step * tokens_per_step / max(train_seconds, 1e-9),
            "train_loss": float(np.mean(tail)) if tail else None,  # mean of the last 5 logged intervals
            "test_loss": test_loss, "test_perplexity": math.exp(test_loss), "test_tokens_scored": n_scored,
            "test_bits_per_byte": test_loss * n_scored / math.log(2) / test_bytes,
            "val_loss": val_loss, "val_perplexity": math.exp(val_loss),
            "unigram_test_perplexity": uni, "unigram_val_fit_test_perplexity": uni_val,
            "perplexity_ratio_to_unigram": math.exp(test_loss) / uni, "sample_prompt": SAMPLE_PROMPT, "sample": sample,
            "compiled": compiled,
        }
        log = {"model": asdict(cfg), "params": n_params, "train_config": asdict(t), "final": final,
               "hf_check": hf_check, "train_py_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
               "data": manifest["tokens"], "torch": torch.__version__,
               "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "logs": logs, "evals": evals}
        (stage / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        plot_loss(log, stage / "loss.png")
        (stage / "README.md").write_text(model_card(log, manifest))
        os.chmod(stage, 0o755)  # mkdtemp makes it private; the model is an ordinary directory
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked before training
        os.replace(stage, out_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise

    print(f"final: steps {step}, tokens seen {final['tokens_seen']:,} ({final['epochs']:.1f} epochs) in "
          f"{train_seconds:.0f} s ({final['tokens_per_s'] / 1e6:.2f} M tokens/s)")
    print(f"final train loss {final['train_loss']:.4f}; held-out WikiText-2 test loss {test_loss:.4f}, "
          f"perplexity {final['test_perplexity']:.1f}, {final['test_bits_per_byte']:.3f} bits/byte; "
          f"val (calibration) perplexity {final['val_perplexity']:.1f}")
    print(f"unigram perplexity on test: {uni:.1f} (fit on train; ratio {final['perplexity_ratio_to_unigram']:.3f}), "
          f"{uni_val:.1f} (fit on WikiText-2 valid)")
    print(f"hf check: {hf_check}")
    print(f"sample (greedy): {sample!r}")
    return log


def _check_with_transformers(model: Llama, out_dir: Path, window: torch.Tensor) -> dict:
    """Load the saved directory with transformers and compare its logits with ours (fp32, same bf16 weights)."""
    try:
        from transformers import LlamaForCausalLM
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers not importable: {e}"}
    try:  # a diagnostic after the weights are saved: a failure here must not lose the run's log
        hf = LlamaForCausalLM.from_pretrained(out_dir).float().to(window.device).eval()
        with torch.no_grad():
            ref = hf(window[None]).logits.float()
            ours = model(window[None]).float()
    except Exception as e:
        return {"transformers": transformers.__version__, "error": f"{type(e).__name__}: {e}"}
    return {"transformers": transformers.__version__, "max_abs_logit_diff": (ref - ours).abs().max().item(),
            "argmax_agreement": (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()}


def plot_loss(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot([r["tokens"] / 1e6 for r in log["logs"]], [r["train_loss"] for r in log["logs"]], lw=1, label="train")
    ax.plot([r["tokens"] / 1e6 for r in log["evals"]], [r["test_loss"] for r in log["evals"]], "o-", ms=3,
            label=f"held-out WikiText-2 test ({log['train_config']['eval_windows']} windows)")
    ax.axhline(math.log(log["final"]["unigram_test_perplexity"]), ls="--", c="gray", lw=1,
               label="unigram (fit on train) on test")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 10.0))
    f = log["final"]
    ax.set_title(f"reference LLaMA {log['params'] / 1e6:.1f}M: test ppl {f['test_perplexity']:.0f}, "
                 f"unigram {f['unigram_test_perplexity']:.0f}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def model_card(log: dict, manifest: dict) -> str:
    f, m, t = log["final"], log["model"], log["train_config"]
    src = "\n".join(f"| {k} | {v['license']} | {v['docs']} | {v['bytes']:,} | `{v['sha256'][:16]}` |"
                    for k, v in manifest["sources"].items())
    return f"""# rankserve reference LLaMA ({log['params'] / 1e6:.1f}M parameters)

A small LLaMA-architecture model trained from scratch on real text available offline, as the dense reference for
rankserve's low-rank compression. Not a useful assistant: a test article with real weights.

- Architecture: LLaMA (RMSNorm, RoPE theta {m['rope_theta']:g}, GQA {m['n_heads']} query / {m['n_kv_heads']} KV heads of
  {m['head_dim']}, SwiGLU {m['intermediate_size']}), hidden {m['dim']}, {m['n_layers']} layers, vocab {m['vocab_size']},
  tied embeddings, context {m['max_seq_len']}. {log['params']:,} parameters; weights stored in bf16.
- Tokenizer: byte-level BPE, {m['vocab_size']} tokens (`<unk>`=0, `<s>`=1, `</s>`=2), trained on the corpus below.
- Training: {f['steps']:,} steps x {t['batch_size']} x {t['seq_len']} tokens = {f['tokens_seen']:,} tokens seen
  ({f['epochs']:.1f} epochs of {manifest['tokens']['train']['tokens']:,} train tokens), AdamW (0.9, 0.95),
  peak lr {t['lr']:g}, warmup {t['warmup_steps']} + cosine to {t['min_lr_frac']:g}x, weight decay {t['weight_decay']:g},
  bf16 autocast, seed {t['seed']}, {f['train_seconds']:.0f} s on {log['device_name']} (torch {log['torch']}).
- Final train loss {f['train_loss']:.4f} (mean of the last logged intervals).
- Held-out WikiText-2 raw test (never trained on): loss {f['test_loss']:.4f}, perplexity {f['test_perplexity']:.1f},
  {f['test_bits_per_byte']:.3f} bits/byte, over {f['test_tokens_scored']:,} tokens in non-overlapping
  {t['seq_len']}-token windows.
- Unigram baseline on the same tokens (add-one smoothed): {f['unigram_test_perplexity']:.1f} fit on the train corpus
  (ratio {f['perplexity_ratio_to_unigram']:.3f}), {f['unigram_val_fit_test_perplexity']:.1f} fit on WikiText-2 valid.
- WikiText-2 valid (calibration set, also held out): perplexity {f['val_perplexity']:.1f}.
- Greedy sample from "{f['sample_prompt']}": {f['sample']!r}
- transformers check: {log['hf_check']}
- Training script: `compress/train.py` sha256 `{log['train_py_sha256']}`; commit: (fill in when committed).

## Corpus (`compress/corpus.py`, deduplicated; manifest sha256 of train.jsonl `{manifest['train']['sha256'][:16]}`)

| source | license | documents | bytes | sha256 |
| --- | --- | --- | --- | --- |
{src}

Held out: WikiText-2 raw test (evaluation, sha256 `{manifest['heldout']['test']['sha256'][:16]}`) and WikiText-2 valid
(calibration, sha256 `{manifest['heldout']['val']['sha256'][:16]}`); {manifest['heldout_paragraphs_in_train']} of their
paragraphs appear in train. Licenses of the sources apply to the corpus; WikiText-2 is CC BY-SA 3.0.

## Reproduce
    python -m rankserve.compress.corpus --out .carry/corpus
    python -m rankserve.compress.bpe --corpus .carry/corpus --out .carry/reference
    python -m rankserve.compress.train --data .carry/reference --out OUT --max-steps {f['steps']} --seed {t['seed']}
"""


def _autocast(device):
    # bf16 autocast on the GPU; fp32 on CPU, where the smoke run only checks plumbing
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    start_time = time.time()
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".carry/reference"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=d.preset)
    ap.add_argument("--minutes", type=float, default=d.minutes, help="wall budget from start to the last step")
    ap.add_argument("--max-steps", type=int, default=d.max_steps, help="fix the step count (overrides --minutes)")
    ap.add_argument("--max-epochs", type=float, default=d.max_epochs, help="cap on passes over the training tokens")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows)
    ap.add_argument("--final-eval-windows", type=int, default=d.final_eval_windows)
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    a = vars(ap.parse_args(argv))
    data, out = a.pop("data"), a.pop("out")
    t = replace(d, **a)
    if t.device == "cpu" and t.max_steps is None:
        ap.error("--device cpu needs --max-steps (the time budget is sized for a GPU)")
    try:
        train(data, out, t, start_time=start_time)
    except (FileNotFoundError, FileExistsError) as e:  # checked before training: a one-line error
        ap.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
