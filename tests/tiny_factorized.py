"""A one-layer factorized model with random weights, for tests of the PARSE quality benches' helpers."""

import torch

from rankserve.workers.config import ModelConfig
from rankserve.workers.model import PROJS, Transformer, proj_name

CFG = ModelConfig(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)


def tiny_model(rank: int) -> Transformer:
    """Every projection of the one layer factorized at `rank`, weights ~ N(0, 0.3²) (seed 0), eval mode."""
    torch.manual_seed(0)
    model = Transformer(CFG, {proj_name(0, p): rank for p in PROJS}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model
