"""Model configuration: the HF LLaMA fields rankserve's runtime needs, nothing more.

`ModelConfig` reads and writes the `config.json` of a native checkpoint. Both HF spellings of RoPE
settings are understood: transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`).
We always write the 4.x spelling plus `rope_parameters`, so either transformers version loads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", "factor": ...}
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling and "type" in self.rope_scaling:
            # transformers' older spelling; every reader below looks at "rope_type" only
            self.rope_scaling = {("rope_type" if k == "type" else k): v for k, v in self.rope_scaling.items()}
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                problems.append(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    # derived sizes -------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(int(t) for t in self.eos_token_id)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each decoder projection, keyed by short name."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q": (self.q_dim, h), "k": (self.kv_dim, h), "v": (self.kv_dim, h), "o": (h, self.q_dim),
                "gate": (i, h), "up": (i, h), "down": (h, i)}

    def dense_linear_params(self) -> int:
        """Parameters of all dense decoder linears: the denominator of the keep ratio."""
        return self.num_hidden_layers * sum(o * i for o, i in self.linear_shapes().values())

    # HF config.json ----------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from an HF LLaMA config dict (transformers 4.x or 5.x spelling)."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks required LLaMA fields: {', '.join(missing)}")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # SiLU-gated MLP (HF's swish is SiLU): another would run as SiLU, wrong
            raise ValueError(f"hidden_act {act!r} is not supported (rankserve's LLaMA MLP uses silu)")
        rope_theta = d.get("rope_theta")
        scaling = d.get("rope_scaling")
        params = d.get("rope_parameters")
        if params:  # transformers 5.x folds theta and scaling into one dict
            params = dict(params)
            rope_theta = params.pop("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        if scaling is not None:
            scaling = dict(scaling)
            if "type" in scaling and "rope_type" not in scaling:
                scaling["rope_type"] = scaling.pop("type")
            if scaling.get("rope_type", "default") == "default":
                scaling = None
        head_dim = d.get("head_dim") or 0
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=int(head_dim),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_id=d.get("eos_token_id", 2),
        )

    def to_hf(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, torch_dtype="float32")
        params = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            params.update(self.rope_scaling)
        d["rope_parameters"] = params
        return d


PRESETS: dict[str, dict[str, Any]] = {
    # LLaMA-7B shape (benchmarks use it with random weights)
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=20480,
                     rms_norm_eps=1e-6),
    # a few-MB model for smoke tests of the benchmarks on CPU
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    # karpathy's stories260K (bundled as models/stories260K)
    "stories260K": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=5,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                        rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})

