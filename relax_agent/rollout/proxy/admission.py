"""The token-budget check a request passes before anything of it is tokenized: its message text
alone must be able to fit the episode's ``max_total_tokens``, bounded from below by bytes, so a
body that cannot fit is refused in milliseconds instead of after a full render and tokenization."""

from __future__ import annotations

import weakref
from typing import Any

from relax_agent.rollout.chat import text_of
from relax_agent.rollout.proxy.openai_api import ChatRequest, RequestError

_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer: Any) -> int:
    """The UTF-8 length of the longest entry of ``tokenizer``'s vocabulary (``get_vocab()``, special
    tokens included): at least the number of bytes of text any one token stands for (byte-level
    entries such as ``Ġ`` count 2 bytes for 1, so this over-estimates them). Computed once per
    tokenizer."""
    if tokenizer not in _TOKEN_BYTES:
        entries = tokenizer.get_vocab()
        _TOKEN_BYTES[tokenizer] = max((len(e) if isinstance(e, bytes) else len(str(e).encode("utf-8", "surrogatepass"))
                                       for e in entries), default=1)
    return _TOKEN_BYTES[tokenizer]


def check_fits(req: ChatRequest, tokenizer: Any, max_total_tokens: int) -> None:
    """Refuse a request whose message text cannot fit ``max_total_tokens``: its system, user and tool
    texts (which chat templates render verbatim) of B bytes are at least ceil(B / L) tokens, L =
    :func:`max_token_bytes`. A request that passes may still be refused once tokenized.

    Raises:
        RequestError: 400 ``context_length_exceeded`` naming the bound and the budget.
    """
    num_bytes = sum(len(text_of(m.get("content")).encode("utf-8", "surrogatepass")) for m in req.messages
                    if m.get("role") in ("system", "user", "tool"))
    per_token = max_token_bytes(tokenizer)
    least = -(-num_bytes // per_token)
    if least >= max_total_tokens:
        raise RequestError(f"the conversation's system, user and tool messages hold {num_bytes} bytes of text, at least "
                           f"{least} tokens (no token of the policy covers more than {per_token} bytes): at or past "
                           f"this episode's budget rollout.max_total_tokens={max_total_tokens}", "messages",
                           code="context_length_exceeded")
