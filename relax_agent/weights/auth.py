"""The run's weight credential: who may publish, subscribe to and download the policy's weights.

Every run has one secret that its subscribers hold (the *subscriber secret*), and, under
``runtime: ray``, a second one only the trainer holds (the *publisher secret*):

* tcp transport: every connection to the weight server answers a challenge before any byte of a
  weight is sent: the server sends a random 32-byte nonce, the subscriber answers
  ``HMAC-SHA256(subscriber secret, CONTEXT + nonce)``, compared with :func:`hmac.compare_digest`;
  a wrong or missing answer closes the connection (logged with the peer's address). The secret
  itself never crosses the wire.
* the coordinator's HTTP service: the subscriber secret is its bearer token
  (``weights.service_token_env``, or a random one per run, ``WeightSync.service_token``).
* the coordinator Ray actor: every call carries the caller's :class:`RunCredential`; mutating
  the published version (``register_publisher``, ``commit``, ``retract``) needs the publisher
  secret, everything else the subscriber secret.

Where the secret comes from: ``weights.service_token_env`` when set (processes started outside the
run, e.g. ``connect_subscriber`` in another shell, read the same variable); otherwise a random one
made at start by the publisher (:func:`build_weight_sync`) or by the Ray driver, and handed to the
processes the run starts (Ray actor arguments), never written to disk or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

CONTEXT = b"relax-agent weights tcp v1|"
"""Domain separation: the tcp answer is an HMAC of this prefix and the nonce, never of the nonce alone."""
NONCE_BYTES = 32
ANSWER_BYTES = 32  # sha256


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def answer(secret: str, nonce: bytes) -> bytes:
    """The subscriber's answer to the weight server's challenge ``nonce``: HMAC-SHA256 (32 bytes)."""
    return hmac.new(secret.encode(), CONTEXT + nonce, hashlib.sha256).digest()


def verify_answer(secret: str, nonce: bytes, given: bytes) -> bool:
    """Whether ``given`` is the right answer to ``nonce`` (constant-time compare)."""
    return hmac.compare_digest(answer(secret, nonce), given)


def same_secret(expected: str | None, given: object) -> bool:
    """Constant-time ``given == expected`` for secrets; False when either is missing or not a string."""
    return isinstance(expected, str) and isinstance(given, str) and hmac.compare_digest(given.encode(),
                                                                                         expected.encode())


@dataclass(frozen=True)
class RunCredential:
    """What a process of the run holds: the subscriber secret, and the publisher secret for the trainer.

    Attributes:
        subscriber: lets its holder register as a subscriber, poll and report, and download weights.
        publisher: lets its holder register as the publisher and commit or retract versions (None:
            a subscriber-only credential, what rollout replicas get).
    """

    subscriber: str
    publisher: str | None = None

    @classmethod
    def generate(cls, subscriber: str | None = None) -> RunCredential:
        """A credential with a fresh publisher secret and ``subscriber`` (None: a fresh one too)."""
        return cls(subscriber or new_secret(), new_secret())

    def subscriber_only(self) -> RunCredential:
        """The same credential without the publisher secret (for rollout replicas)."""
        return RunCredential(self.subscriber)

    def __repr__(self) -> str:  # never print a secret
        return f"RunCredential(publisher={'yes' if self.publisher else 'no'})"
