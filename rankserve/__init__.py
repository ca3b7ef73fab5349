"""rankserve: serve low-rank (SVD-compressed) LLaMA models fast."""

__version__ = "0.1.0"
