"""A reply's text from its token ids: incremental detokenization as tokens stream, each token's raw
bytes (``logprobs``), and where stop strings or a kept closing tag end the reply."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class IncrementalText:
    """The text of a growing list of token ids, decoding only a short window at its end per token
    (constant work per token instead of re-decoding the whole reply), after vLLM's incremental
    detokenization (``detokenize_incrementally``: a prefix window decoded with and without the new
    tokens; text is released only once it no longer ends in a partial UTF-8 character).

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; the text so far (its last partial character held back)."""
        self.ids.append(token_id)
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level BPE alphabet (``bytes_to_unicode`` of its reference
    implementation, openai/gpt-2 ``encoder.py``): printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> tuple[bytes, ...]:
    """[n] the raw bytes of each token (a token may hold part of a UTF-8 character, which its own
    decoded text cannot show): byte-level BPE pieces mapped back through GPT-2's byte alphabet,
    SentencePiece byte pieces (``<0xE2>``) as that byte, other pieces as their decoded text's UTF-8."""
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True):
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                out.append(bytes([int(piece[3:5], 16)]))
                continue
            except ValueError:
                pass
        if isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
            out.append(bytes(_BYTE_DECODER[ch] for ch in piece))
        else:
            out.append(tokenizer.decode([i]).encode())
    return tuple(out)


def marker_cut(text: str, markers: list[tuple[str, bool]]) -> int | None:
    """End of the reply's text at the earliest marker (before a stop string, after a kept tag), or None."""
    best: tuple[int, int] | None = None
    for marker, keep in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(marker) if keep else i)
    return None if best is None else best[1]


def stop_hit(text: str, markers: list[tuple[str, bool]]) -> str | None:
    """The stop string (a marker not kept) that ends ``text`` at the earliest marker, or None."""
    found = [(i, marker) for marker, keep in markers if (i := text.find(marker)) >= 0]
    if not found:
        return None
    i, marker = min(found)
    return None if dict(markers)[marker] else marker
