"""Tokenizer of a model directory: HF `tokenizer.json` (tokenizers) or SentencePiece `tokenizer.model`.

Encoding never adds special tokens by itself; `encode(text, bos=True)` prepends the BOS id explicitly,
so every backend behaves the same way (llama2.c and HF LLaMA both start a prompt with BOS).
"""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, backend: str, impl, bos_id: int | None, eos_id: int | None, vocab_size: int) -> None:
        self.backend, self._impl = backend, impl
        self.bos_id, self.eos_id, self.vocab_size = bos_id, eos_id, vocab_size
        # GPT-2 style byte-level BPE writes each byte as one printable character (token_bytes maps them back)
        self.byte_level = backend == "tokenizers" and type(impl.decoder).__name__ == "ByteLevel"

    @classmethod
    def load(cls, model_dir: str | Path) -> "Tokenizer":
        """The tokenizer of `model_dir`; refused when it can emit ids the model has no embedding for."""
        from rankserve.workers.checkpoint import CheckpointError  # the checkpoint module pulls in torch

        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        cfg = cfg if isinstance(cfg, dict) else {}
        tok = cls._read(d, cfg)
        vocab = cfg.get("vocab_size")
        if isinstance(vocab, int) and tok.vocab_size > vocab:
            raise CheckpointError(f"{d}: the tokenizer has {tok.vocab_size} tokens but the model only {vocab} "
                                  f"(config.json vocab_size); the tokenizer files belong to another model")
        return tok

    @classmethod
    def _read(cls, d: Path, cfg: dict) -> "Tokenizer":
        from rankserve.workers.checkpoint import CheckpointError

        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # tokenizers raises its own untyped Exception for a malformed file
                raise CheckpointError(f"{d / 'tokenizer.json'} is not a readable tokenizer: {e}") from None
            bos = cfg.get("bos_token_id", tok.token_to_id("<s>"))
            return cls("tokenizers", tok, bos, eos if eos is not None else tok.token_to_id("</s>"), tok.get_vocab_size())
        if (d / "tokenizer.model").is_file():
            import sentencepiece as spm

            try:
                sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
            except (RuntimeError, OSError) as e:  # "could not parse ModelProto" for a corrupt file
                msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"{d / 'tokenizer.model'} is not a readable SentencePiece model ({msg})") from None
            bos = sp.bos_id() if sp.bos_id() >= 0 else cfg.get("bos_token_id")
            return cls("sentencepiece", sp, bos, sp.eos_id() if sp.eos_id() >= 0 else eos, sp.get_piece_size())
        raise FileNotFoundError(f"{d} has no tokenizer.json or tokenizer.model")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """`text`'s ids, BOS first with `bos`; ValueError for text the backend can't read (a lone surrogate such as
        JSON's "\\ud800" is no UTF-8), so a server answers it as bad input."""
        try:
            if self.backend == "tokenizers":
                ids = self._impl.encode(text, add_special_tokens=False).ids
            else:
                ids = self._impl.encode(text)
        except (TypeError, RuntimeError) as e:  # tokenizers: TypeError; sentencepiece: RuntimeError ("Unable to cast")
            raise ValueError(_unreadable(text, e)) from e
        return ([self.bos_id] if bos and self.bos_id is not None else []) + list(ids)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (b"" for BOS/EOS and other control tokens): what OpenAI's logprobs call
        `bytes`, exact where the text of one token is only part of a UTF-8 character."""
        i = int(i)
        if i in (self.bos_id, self.eos_id) or not 0 <= i < self.vocab_size:
            return b""
        if self.backend == "sentencepiece":
            sp = self._impl
            if sp.is_control(i) or sp.is_unknown(i):
                return b""
            piece = sp.id_to_piece(i)
            return bytes([int(piece[3:5], 16)]) if sp.is_byte(i) else piece.replace("\u2581", " ").encode()
        piece = self._impl.id_to_token(i)
        if piece is None:
            return b""
        if self.byte_level:
            return bytes(_BYTE_OF_CHAR.get(c, 0) for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback (LLaMA's BPE)
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode(self, ids: list[int]) -> str:
        special = {self.bos_id, self.eos_id}
        ids = [int(i) for i in ids if i not in special]
        if self.backend == "tokenizers":
            return self._impl.decode(ids, skip_special_tokens=True)
        return self._impl.decode(ids)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes byte b as a printable character: itself for printable Latin-1, else chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


def _unreadable(text: str, e: Exception) -> str:
    """Why a tokenizer backend refused `text`, without the text itself (an error message must encode as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as u:
        return (f"the text holds a lone surrogate (U+{ord(text[u.start]):04X}) at character {u.start}, which UTF-8 "
                "can't encode; send valid Unicode text")
    return f"the tokenizer could not read the text ({type(e).__name__}: {str(e)[:200]})"
