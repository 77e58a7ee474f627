"""Where an assistant turn ends: the fixed context turn the template renders alone and followed by
new messages, and the token that closes it (see the package doc), from which deltas are cut."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relax_agent.errors import ConfigError
from relax_agent.rollout.chat.plain import PlainText

REF_USER = {"role": "user", "content": "ping"}
REF_ASSISTANT = "pong"


class Deltas(PlainText):
    """:class:`~relax_agent.rollout.chat.ChatRenderer`'s context turn and closing-token search."""

    tool_role: str
    append_only: bool
    _heads: dict[tuple[tuple[str, str], ...], str]
    _call_content: str
    _gen_prefix: str
    _special_ids: frozenset[int]
    _stop_ids: frozenset[int]

    def _head(self, calls: tuple[tuple[str, str], ...]) -> dict[str, Any]:
        """The context assistant turn: fixed text, plus one tool call ``(id, name)`` per tool result that
        follows (templates may require ``tool_calls`` before a tool message; Gemma 4 names the tool in
        the result, so the names are the sampled calls' where known)."""
        if not calls:
            return {"role": "assistant", "content": REF_ASSISTANT}
        return {"role": "assistant", "content": self._call_content,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": {}}} for i, n in calls]}

    def _after_assistant(self, new: list[dict[str, Any]],
                         sampled_calls: Sequence[dict[str, Any]] = ()) -> tuple[str, str]:
        """Render the context's assistant turn alone and followed by ``new`` (with the generation prompt).

        Args:
            new: the messages after the turn.
            sampled_calls: the tool calls the policy made in the turn (OpenAI format); they name the
                context turn's calls (matched to the tool results by ``tool_call_id``, else in order).

        Returns:
            (the turn alone, the turn followed by ``new``), each after the generation prompt.
        """
        new = [self._as_user(m) if m["role"] == "tool" and self.tool_role == "user" else m for m in new]
        names = {str(c.get("id")): str(c.get("function", {}).get("name", "tool")) for c in sampled_calls}
        in_order = [str(c.get("function", {}).get("name", "tool")) for c in sampled_calls]
        calls: list[tuple[str, str]] = []
        for i, m in enumerate(new):
            if m["role"] == "tool":
                k = len(calls)
                new[i] = {"tool_call_id": f"call_{k}", **m}
                call_id = str(new[i]["tool_call_id"])
                name = names.get(call_id) or (in_order[k] if k < len(in_order) else "tool")
                calls.append((call_id, name))
        key = tuple(calls)
        if key not in self._heads:
            if len(self._heads) >= 64:  # ids come from the env: keep the cache bounded
                self._heads.clear()
            self._heads[key] = self._render([REF_USER, self._head(key)])[len(self._gen_prefix):]
        full = self._render([REF_USER, self._head(key), *new], gen=True)
        if not full.startswith(self._gen_prefix):
            raise ConfigError("model.path: the chat template renders the context before an assistant turn differently "
                              "once more messages follow it; token-in/token-out needs a stable prefix")
        return self._heads[key], full[len(self._gen_prefix):]

    def _closing_token(self, closed: str, tail: str, roles: list[str]) -> tuple[int, int]:
        """Character span in ``tail`` of the token closing the assistant turn (see the package doc).

        Templates that render a past assistant turn differently *before* its content (Qwen3
        drops the ``<think>`` block of turns before the last user query) are aligned from the
        content on: the sampled turn is never re-rendered, so only what follows the content (tool
        calls, the closing token) has to agree with what the policy sampled. Only a template that
        renders *less* before the content is aligned so; one that renders more there (Gemma 4 puts
        the tool results before a past turn's content) is not dropping history.
        """
        ca, ta = closed.rfind(REF_ASSISTANT), tail.find(REF_ASSISTANT)
        try:
            span = self._closing_token_from(closed, tail, roles, 0, ca + len(REF_ASSISTANT) if ca >= 0 else 0)
        except ConfigError:
            if ca <= 0 or ta < 0 or closed[:ca] == tail[:ta] or ta >= ca:
                raise
            span = self._closing_token_from(closed[ca:], tail[ta:], roles, ta, len(REF_ASSISTANT))
            self.append_only = False
        if ta >= 0 and span[0] < ta + len(REF_ASSISTANT):
            raise ConfigError(
                f"model.path: the chat template closes an assistant turn with no special token after its content "
                f"(its last special token, {tail[span[0]:span[1]]!r}, comes before it: {tail[:80]!r}); "
                "token-in/token-out needs one (the engine stops on it)")
        return span

    def _closing_token_from(self, closed: str, tail: str, roles: list[str], ta: int, content_end: int) -> tuple[int, int]:
        """:meth:`_closing_token` on ``closed`` and ``tail``, where ``tail`` starts at character ``ta`` of
        the full tail (the returned span is in full-tail characters) and the turn's content ends at
        character ``content_end`` of ``closed``.

        Where ``closed`` is a prefix of ``tail``, the closing token is the last special token of the
        turn alone; but where no token after the content is one the engine stops on and the next
        token of ``tail`` is (GLM-4.5+ ends a turn with the next role's token, ``<|observation|>``
        or ``<|user|>``, which the policy samples), it is that next token.
        """
        a = self.tokenizer(closed, add_special_tokens=False, return_offsets_mapping=True)
        b = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
        a_ids, b_ids = list(a["input_ids"]), list(b["input_ids"])
        k = next((j for j, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y), min(len(a_ids), len(b_ids)))
        special = self._special_ids
        if k < len(a_ids):  # the template closes the turn with another token when `roles` follow
            if k < len(b_ids) and a_ids[k] in special and b_ids[k] in special:
                return _shift(b["offset_mapping"][k], ta)
            raise ConfigError(
                f"model.path: the chat template renders an assistant turn differently when {roles} follow "
                f"({closed[:80]!r} vs {tail[:80]!r}), not only by its closing token or before its content; "
                "token-in/token-out cannot append observations to sampled turns with this template"
            )
        after = [j for j in range(len(a_ids)) if a["offset_mapping"][j][0] >= content_end]
        if k < len(b_ids) and b_ids[k] in self._stop_ids and not any(a_ids[j] in self._stop_ids for j in after):
            return _shift(b["offset_mapping"][k], ta)  # the next role's token closes the turn (GLM)
        ends = [j for j in range(len(a_ids)) if a_ids[j] in special]
        j = ends[-1] if ends else k
        if j >= len(b_ids) or b_ids[j] not in special:
            raise ConfigError(
                f"model.path: the chat template closes an assistant turn with no special token (after the turn it "
                f"renders {tail[:80]!r}); token-in/token-out needs one (the engine stops on it)"
            )
        return _shift(b["offset_mapping"][j], ta)

    @staticmethod
    def _as_user(m: dict[str, Any]) -> dict[str, Any]:
        """A tool result as a user message, wrapped in ``<tool_response>`` (parts stay parts)."""
        content = m["content"]
        if isinstance(content, str):
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *content,
                                            {"type": "text", "text": "\n</tool_response>"}]}


def _shift(span: Any, by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by
