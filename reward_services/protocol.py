"""The reward-service protocol: JSON models shared by the HTTP API and in-process rewards.

Wire format (API version ``v1``)::

    POST /v1/reward   {"items": [{"id", "messages", "response", "ground_truth", "metadata"}, ...]}
                   -> {"results": [{"id", "reward", "status", "metrics", "extra"}, ...]}
    GET  /healthz  -> {"status": "ok", "api_version": "v1"}

``status`` separates a wrong answer (``reward: 0.0, status: "ok"``) from an infrastructure
failure (``status: "error"`` or ``"timeout"``, ``reward: null``): failed items are masked out
of the policy gradient and counted, never scored 0. ``POST /v1/reward`` with an empty
``items`` list is the authenticated no-op a client uses to check its token at start-up.

Rewards and metrics are checked here, once, for every path (HTTP, in-process, combined): a
value is a JSON number (an int or a float, never a string or a boolean) that stays finite in
float32, the dtype rewards take on the data bus. A bad reward makes its result invalid; a bad
metric is dropped and named in ``extra["dropped_metrics"]``, so it never costs the real reward.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from relax_agent.records import RewardStatus

API_VERSION = "v1"
REWARD_PATH = f"/{API_VERSION}/reward"
HEALTH_PATH = "/healthz"

ERROR_KEY = "error"
"""Key of ``RewardResult.extra`` holding the cause of an ``error``/``timeout`` result."""
DROPPED_METRICS_KEY = "dropped_metrics"
"""Key of ``RewardResult.extra`` naming the metrics that were not finite numbers (dropped)."""

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32; rewards and metrics beyond it would become inf on the data bus."""


def check_number(value: Any, what: str) -> float:
    """``value`` as a float if it is a number that is finite in float32.

    Args:
        value: an int or float (numpy scalars count); ``bool`` and strings are refused.
        what: names the value in the error (``"reward"``, ``"metric 'correct'"``).

    Raises:
        ValueError: ``value`` is not a number, or not finite in float32; the message names it.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {repr(value)[:80]}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
        raise ValueError(f"{what} must be finite in float32 (|x| <= {FLOAT32_MAX:.4g}), got {str(value)[:80]}")
    return x


def invalid_fields(exc: Exception) -> str:
    """A one-line summary of a validation error: ``"reward: reward must be a number, got str '0.7'"``."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()))
        parts.append(f"{loc or 'result'}: {e.get('msg', 'invalid').removeprefix('Value error, ')}")
    return "; ".join(parts)


class RewardItem(BaseModel):
    """One sample to score.

    Attributes:
        id: unique within a request; the result carries the same id.
        messages: the conversation so far as OpenAI-format chat messages.
        response: the policy's final answer: text, or an assistant message
            ``{"role": "assistant", "content", "tool_calls": [...]}``.
        ground_truth: the task's reference (an answer string, a BFCL task dict, ...).
        metadata: anything else the reward needs (task id, env name, env reward...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    response: str | dict[str, Any] = ""
    ground_truth: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def response_text(self) -> str:
        """The response as text: the string itself, or the assistant message's ``content``."""
        if isinstance(self.response, str):
            return self.response
        content = self.response.get("content") or ""
        if isinstance(content, list):  # content parts
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The response's OpenAI-format ``tool_calls`` (empty for a text response)."""
        if isinstance(self.response, str):
            return []
        return list(self.response.get("tool_calls") or [])


class RewardResult(BaseModel):
    """The score of one item.

    Attributes:
        id: the item's id.
        reward: finite scalar when ``status`` is ok; None otherwise (a failed item has no reward).
        status: ok / error / timeout.
        metrics: named scalars for logging (``correct``, ``well_formed``, ...).
        extra: anything else (judge rationale, parsed answer; ``extra["error"]`` holds the
            cause of an error or timeout).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    reward: float | None = None
    status: RewardStatus = RewardStatus.OK
    metrics: dict[str, float] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _drop_bad_metrics(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
            return data
        good, bad = {}, []
        for key, value in data["metrics"].items():
            try:
                good[key] = check_number(value, f"metric {key!r}")
            except ValueError:
                bad.append(str(key))
        if not bad:
            return data
        extra = data.get("extra")
        extra = dict(extra) if isinstance(extra, dict) else {}
        prior = extra.get(DROPPED_METRICS_KEY)
        extra[DROPPED_METRICS_KEY] = sorted({*(prior if isinstance(prior, list) else []), *bad})
        return {**data, "metrics": good, "extra": extra}

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_is_a_number(cls, value: Any) -> Any:
        return None if value is None else check_number(value, "reward")

    @model_validator(mode="after")
    def _reward_matches_status(self) -> RewardResult:
        if self.status is RewardStatus.OK:
            if self.reward is None:
                raise ValueError("reward must be a finite number when status is 'ok', got None")
        elif self.reward is not None:
            object.__setattr__(self, "reward", None)  # a failed item carries no reward
        return self

    @property
    def ok(self) -> bool:
        """True when the reward is real and may enter the policy gradient."""
        return self.status is RewardStatus.OK

    @classmethod
    def failed(cls, id: str, status: RewardStatus, cause: str, **extra: Any) -> RewardResult:
        """An error/timeout result with ``extra["error"] = cause``."""
        assert status is not RewardStatus.OK
        return cls(id=id, reward=None, status=status, extra={ERROR_KEY: cause, **extra})


class RewardRequest(BaseModel):
    """Body of ``POST /v1/reward``: a batch of items with distinct ids (may be empty)."""

    model_config = ConfigDict(extra="forbid")

    items: list[RewardItem]

    @field_validator("items")
    @classmethod
    def _distinct_ids(cls, items: list[RewardItem]) -> list[RewardItem]:
        seen: set[str] = set()
        for item in items:
            if item.id in seen:
                raise ValueError(f"duplicate item id {item.id!r}; ids must be unique within a request")
            seen.add(item.id)
        return items


class RewardResponse(BaseModel):
    """Body of a ``200`` answer to ``POST /v1/reward``: one result per item, in item order."""

    model_config = ConfigDict(extra="forbid")

    results: list[RewardResult]


class HealthResponse(BaseModel):
    """Body of ``GET /healthz``."""

    status: str = "ok"
    api_version: str = API_VERSION


@runtime_checkable
class RewardFunction(Protocol):
    """Anything that scores items: an in-process function, a remote service, a combination.

    ``score`` returns one result per item, in item order, and never raises for a failure of
    one item (that item gets status error/timeout). It raises only for failures that make
    every later call fail too (a refused token: :class:`~relax_agent.errors.AuthError`).
    """

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """One result per item, in item order (a failure of one item is its result, not an exception).

        Raises:
            AuthError: the service refused the token (every later call would fail too).
        """

    async def aclose(self) -> None:
        """Release connections and workers; the function is not used after."""


@runtime_checkable
class ChecksAtStart(Protocol):
    """A :class:`RewardFunction` with a start-up check (remote clients, combinations): the run calls
    it before the first episode, so a wrong address or token fails the run at once."""

    async def check(self) -> None:
        """Raises :class:`~relax_agent.errors.AuthError` or :class:`~relax_agent.errors.RewardServiceError`
        when the reward cannot score."""
        ...


@runtime_checkable
class ReportsHealth(Protocol):
    """A :class:`RewardFunction` that knows when it cannot take work (a local function's worker pool)."""

    def health(self) -> str | None:
        """None while the reward can score; otherwise why not (the service answers 503 with it)."""
        ...


def rewards_and_mask(results: list[RewardResult]) -> tuple[list[float], list[bool]]:
    """Split results into rewards and a policy-gradient mask.

    Returns:
        ``(rewards_N, mask_N)``: the reward of each ok item, ``nan`` for a failed one (so a
        missing mask shows up loudly instead of training on a fake 0); mask is True for ok.
    """
    rewards = [r.reward if r.ok else math.nan for r in results]
    return rewards, [r.ok for r in results]  # type: ignore[return-value]


STATUS_COUNT_KEY = "reward/status/{status}"
"""Metric key counting results per status (``reward/status/ok``, ``reward/status/error``...)."""
MEAN_REWARD_KEY = "reward/mean_ok"
"""Metric key: mean reward over ok results only (failed items never count as 0)."""


def reward_metrics(results: list[RewardResult]) -> dict[str, float]:
    """Counts per status and the mean reward over ok results (``nan`` when none is ok)."""
    out = {STATUS_COUNT_KEY.format(status=s.value): 0.0 for s in RewardStatus}
    for r in results:
        out[STATUS_COUNT_KEY.format(status=r.status.value)] += 1
    ok = [r.reward for r in results if r.ok]
    out[MEAN_REWARD_KEY] = sum(ok) / len(ok) if ok else math.nan  # type: ignore[arg-type]
    return out
