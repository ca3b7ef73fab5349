"""Rank cache: MiniLM prompt embeddings -> PARSE rank subsets, Redis as the truth, a local FAISS index per replica."""

from .cache import Hit, RankCache, RankIndex
from .embedder import DIM, Embedder
from .store import KEY_SCHEMA, RedisStore, model_version

__all__ = ["DIM", "Embedder", "Hit", "KEY_SCHEMA", "RankCache", "RankIndex", "RedisStore", "model_version"]
