"""Rendering through the chat template, and env text (user and tool messages) tokenized as the plain
text it is: an added or special token spelled inside it is split so the tokenizer cannot match it,
so a tool cannot forge turns."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from relax_agent.errors import EnvError

_PLAIN_ROLES = frozenset({"user", "tool"})
"""Roles whose text comes from the env (observations): always tokenized as plain text."""
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def _placeholder(i: int) -> str:
    return f"\ue000{i}\ue001"  # private-use characters: no template trims or escapes them


class PlainText:
    """:class:`~relax_agent.rollout.chat.ChatRenderer`'s template rendering and plain-text tokenization."""

    tokenizer: Any
    _added: tuple[str, ...]

    def _render(self, msgs: Sequence[dict[str, Any]], gen: bool = False, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen, **kwargs)

    def _placeheld(self, msgs: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
        """(texts, ``msgs`` with each user/tool text replaced by placeholder i for texts[i])."""
        texts: list[str] = []

        def hold(text: str) -> str:
            texts.append(text)
            return _placeholder(len(texts) - 1)

        out = []
        for m in msgs:
            content = m["content"]
            if m["role"] in _PLAIN_ROLES:
                if isinstance(content, str):
                    content = hold(content)
                else:
                    content = [{**p, "text": hold(p["text"])} if p.get("type") == "text" else p for p in content]
            out.append({**m, "content": content})
        return texts, out

    def _render_plain(self, msgs: list[dict[str, Any]], gen: bool, **kwargs: Any) -> tuple[str, list[tuple[int, int]] | None]:
        """(rendered text, character spans of user/tool text in it, or None if they cannot be located)."""
        texts, held = self._placeheld(msgs)
        text = self._render(msgs, gen=gen, **kwargs)
        if not self._spells_added(texts):
            return text, []
        return text, self._spans(self._render(held, gen=gen, **kwargs), text, texts)

    def _spells_added(self, texts: list[str]) -> bool:
        return any(tok in t for t in texts for tok in self._added)

    @staticmethod
    def _spans(held: str, text: str, texts: list[str]) -> list[tuple[int, int]] | None:
        """Where ``texts`` sit in ``text``, given its rendering ``held`` with placeholders; None when
        the template changed them (neither verbatim nor trimmed)."""
        parts = _PLACEHOLDER.split(held)  # [structure, index, structure, index, ..., structure]
        for variant in (lambda t: t, str.strip):
            out, spans = [], []
            for k, piece in enumerate(parts):
                if k % 2 == 0:
                    out.append(piece)
                    continue
                start = sum(map(len, out))
                out.append(variant(texts[int(piece)]))
                spans.append((start, start + len(out[-1])))
            if "".join(out) == text:
                return spans
        return None

    def _encode(self, text: str, spans: list[tuple[int, int]] | None) -> list[int]:
        """Token ids of ``text`` in which an added/special token spelled inside ``spans`` is plain text.

        Each such occurrence is split after its first character, so the tokenizer cannot match
        it; text without one is tokenized in one call (identical to plain ``tokenizer(text)``).
        """
        if spans is None:
            raise EnvError("a user/tool message spells a special token (one of the tokenizer's added tokens) and the "
                           "chat template rewrites message content, so it cannot be tokenized as plain text")
        cuts = sorted({s + i + 1 for s, e in spans for tok in self._added for i in _find_all(text[s:e], tok)})
        bounds = [0, *cuts, len(text)]
        ids: list[int] = []
        for lo, hi in itertools.pairwise(bounds):
            ids += self.tokenizer(text[lo:hi], add_special_tokens=False)["input_ids"]
        return ids


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out
