"""What the endpoint remembers about requests across HTTP exchanges: the body each ``Idempotency-Key``
was first accepted with (:class:`IdempotencyKeys`), and the non-streamed requests whose client hung
up (:class:`HangUps`), aborted unless a retry comes back for them."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from relax_agent.rollout.proxy.openai_api import Answer, RequestError
from relax_agent.rollout.proxy.session import AgentSession

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
"""The ASGI ``receive`` of a request whose body was read: it returns ``http.disconnect`` once the client
hangs up."""


class IdempotencyKeys:
    """Per session (its API key): each ``Idempotency-Key`` and the hash of the body first accepted with it.

    A key reused with another body is refused, as the IETF ``Idempotency-Key`` draft and Stripe
    do (a retry must send what it retries), instead of replaying the first answer to a different
    request. A request refused before it was accepted does not keep its key.
    """

    def __init__(self) -> None:
        self._bodies: dict[str, dict[str, str]] = {}

    def claim(self, session_key: str, idempotency_key: str, body_hash: str) -> bool:
        """Bind ``idempotency_key`` to ``body_hash``; True when it was not bound yet.

        Raises:
            RequestError: 422 (``idempotency_key_reused``), the key was bound to another body.
        """
        bodies = self._bodies.setdefault(session_key, {})
        first = bodies.get(idempotency_key)
        if first is None:
            bodies[idempotency_key] = body_hash
            return True
        if first != body_hash:
            raise RequestError(f"Idempotency-Key {idempotency_key!r} was first used with a different request body; "
                               "a retry must send the same body, and a new request a new key",
                               status=422, code="idempotency_key_reused")
        return False

    def release(self, session_key: str, idempotency_key: str) -> None:
        """Unbind a key claimed by a request that was then refused."""
        self._bodies.get(session_key, {}).pop(idempotency_key, None)

    def forget(self, session_key: str) -> None:
        """Drop the keys of an ended session."""
        self._bodies.pop(session_key, None)


class HangUps:
    """Waits for non-streamed answers while watching for the client to hang up.

    A request whose client hung up is aborted (its generation cancelled, nothing of it recorded;
    ``agent/aborted``) ``grace_s`` seconds later unless a retry of it (the same body, replayed from
    the record) is waiting for the same answer by then: the ``openai`` and ``anthropic`` SDKs retry
    a timed-out request after at most 8 s, and the retry then gets the sample already under way.

    Args:
        grace_s: seconds a hung-up request keeps sampling for a retry to come back.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._waiting: collections.Counter[tuple[str, str]] = collections.Counter()

    async def wait(self, receive: Receive, session: AgentSession, body_key: str,
                   answer: asyncio.Future) -> Answer | None:
        """The answer, or None when the client hung up first (the abort is then scheduled and the
        answer, if it comes, marked undelivered).

        Raises:
            Exception: whatever ``answer`` raises.
        """
        key = (session.key, body_key)
        self._waiting[key] += 1
        hang_up = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({answer, hang_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hang_up.cancel()
            self._waiting[key] -= 1
            if self._waiting[key] <= 0:
                del self._waiting[key]
        if answer.done():
            return answer.result()
        answer.add_done_callback(lambda f: _undelivered(session, f))
        asyncio.get_running_loop().call_later(self.grace_s, self._abort_unless_retried, session, body_key)
        return None

    def _abort_unless_retried(self, session: AgentSession, body_key: str) -> None:
        if not self._waiting[(session.key, body_key)] and not session.closed:
            session.abandon(body_key)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive()).get("type") != "http.disconnect":
        pass


def _undelivered(session: AgentSession, answer: asyncio.Future) -> None:
    """Mark the answer of a hung-up request undelivered (a failure needs no mark, but is retrieved)."""
    if not answer.cancelled() and answer.exception() is None:
        session.delivered(answer.result().id, False)
