"""Reward config: where an env's reward comes from, and how components are weighted.

YAML, one source (shorthand)::

    reward:
      source: remote
      url: http://127.0.0.1:8001
      token_env: REWARD_TOKEN

or a weighted combination::

    reward:
      components:
        - {source: env, weight: 1.0}
        - {source: local, function: relax_agent.reward_services.math_reward:score, weight: 0.5}
        - {source: remote, name: judge, url: http://127.0.0.1:8002, weight: 0.5}

``build_reward(cfg)`` turns it into one :class:`RewardFunction`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import Field, field_validator, model_validator

from relax_agent.configbase import Section
from relax_agent.errors import ConfigError
from relax_agent.reward_services.client import RetryPolicy, RewardClient
from relax_agent.reward_services.combine import CombinedReward, Component
from relax_agent.reward_services.env_reward import EnvReward
from relax_agent.reward_services.local import LocalReward
from relax_agent.reward_services.protocol import RewardFunction

log = logging.getLogger("relax_agent.reward_services")

_REMOTE_ONLY = ("url", "token_env", "request_timeout_s", "connect_timeout_s", "request_deadline_s", "max_batch_items",
                "micro_batching", "batch_wait_s",
                "max_attempts", "backoff_initial_s", "backoff_max_s", "retry_max_elapsed_s")
_LOCAL_ONLY = ("function", "kwargs", "timeout_s")


class RewardComponentConfig(Section):
    """One reward source and its weight."""

    source: Literal["env", "local", "remote"] = "env"
    """"env": the env's own episode return (``metadata["env_reward"]``); "local": a Python
    function in this process; "remote": a reward service over HTTP."""
    name: str | None = None
    """Label in metrics (``<name>/reward``); defaults to "env", the function's name, or "remote"."""
    weight: float = 1.0
    function: str | None = None
    """local: ``module:function`` or ``path/to/file.py:function``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """local: arguments for a factory target, e.g. ``relax_agent.reward_services.llm_judge:LLMJudge``."""
    url: str | None = None
    """remote: base URL of the service, e.g. ``http://127.0.0.1:8001``."""
    token_env: str | None = None
    """remote: environment variable holding the bearer token (the token never goes in the config)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """local: deadline per item (a batched function: per call)."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    """remote: timeout of one HTTP request; keep it above the service's own per-item ``--timeout-s``."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_deadline_s: float | None = Field(default=None, gt=0)
    """remote: most seconds one HTTP attempt may take in all, however steadily the answer trickles
    in (``request_timeout_s`` bounds each read only); None: ``2 * request_timeout_s + connect_timeout_s``."""
    max_concurrency: int = Field(default=16, ge=1)
    """Items scored at once (local) or requests in flight (remote)."""
    max_batch_items: int = Field(default=64, ge=1)
    """remote: most items per HTTP request."""
    micro_batching: bool = True
    """remote: merge concurrent score calls into shared requests."""
    batch_wait_s: float = Field(default=0.0, ge=0)
    """remote: how long a free sender waits to fill a batch; 0 sends at once."""
    max_attempts: int = Field(default=20, ge=1)
    """remote: tries per request (transport errors, 429 and 5xx are retried)."""
    backoff_initial_s: float = Field(default=0.25, gt=0)
    backoff_max_s: float = Field(default=4.0, gt=0)
    retry_max_elapsed_s: float = Field(default=60.0, ge=0)
    """remote: no retry starts this many seconds after the first try; the items are then
    masked (status error/timeout), never scored 0."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None:
            _check_url(url)
        return url

    @model_validator(mode="after")
    def _check_source(self) -> RewardComponentConfig:
        if self.source == "local" and not self.function:
            raise ValueError("source: local needs function: 'module:function' or 'path/to/file.py:function'")
        if self.source == "remote" and not self.url:
            raise ValueError("source: remote needs url: e.g. 'http://127.0.0.1:8001'")
        wrong = {"env": (*_REMOTE_ONLY, *_LOCAL_ONLY), "local": _REMOTE_ONLY, "remote": _LOCAL_ONLY}[self.source]
        # A key at its default is not a mistake: a dumped config (saved beside checkpoints) lists every key.
        set_wrong = [k for k in wrong if k in self.model_fields_set
                     and getattr(self, k) != type(self).model_fields[k].get_default(call_default_factory=True)]
        if set_wrong and {"function", "url"} & set(set_wrong):
            raise ValueError(f"source: {self.source} does not take {set_wrong}")
        if set_wrong:
            log.warning("reward component %s: %s ignored for source: %s", self.label, set_wrong, self.source)
        return self

    @property
    def label(self) -> str:
        """The metrics name: ``name`` or a default from the source."""
        if self.name:
            return self.name
        if self.source == "local":
            return str(self.function).rpartition(":")[2].rpartition(".")[2]
        return self.source

    def retry_policy(self) -> RetryPolicy:
        """The component's retry settings as a :class:`RetryPolicy`."""
        return RetryPolicy(max_attempts=self.max_attempts, backoff_initial_s=self.backoff_initial_s,
                           backoff_max_s=self.backoff_max_s, max_elapsed_s=self.retry_max_elapsed_s)


class RewardConfig(Section):
    """An env's reward: one source, or a weighted sum of components (ok only if all are ok)."""

    components: list[RewardComponentConfig] = Field(default_factory=lambda: [RewardComponentConfig()])
    """The terms of the sum; a mapping with ``source`` at the top level is shorthand for one."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and data and "components" not in data:
            return {"components": [data]}
        return data

    @model_validator(mode="after")
    def _check_components(self) -> RewardConfig:
        if not self.components:
            raise ValueError("reward.components must hold at least one component")
        if all(c.weight == 0 for c in self.components):
            keys = ", ".join(f"reward.components.{i}.weight" for i in range(len(self.components)))
            raise ValueError(f"every reward weight is 0 ({keys}): every reward would be 0 and nothing would be "
                             "trained; give at least one component a weight other than 0")
        labels = [c.label for c in self.components]
        dupes = sorted({n for n in labels if labels.count(n) > 1})
        if dupes:
            raise ValueError(f"reward component names {dupes} repeat; give each component a distinct name")
        return self

    def build(self, *, http_transport: httpx.AsyncBaseTransport | None = None) -> RewardFunction:
        """Same as :func:`build_reward`."""
        return build_reward(self, http_transport=http_transport)


def build_reward(cfg: RewardConfig, *, http_transport: httpx.AsyncBaseTransport | None = None) -> RewardFunction:
    """The :class:`RewardFunction` described by ``cfg``.

    A single component of weight 1 is returned as is; otherwise a :class:`CombinedReward`.
    Remote components with the same URL and token share one :class:`RewardClient`. Call
    ``await check_reward(reward)`` before the first rollout to catch a wrong URL or token.

    Args:
        http_transport: httpx transport for remote components (tests); None uses the network.

    Raises:
        ConfigError: a local target does not load, or a token variable is unset.
    """
    clients: dict[tuple[str, str | None], RewardClient] = {}
    components = [Component(c.label, c.weight, _build_one(c, clients, http_transport)) for c in cfg.components]
    if len(components) == 1 and components[0].weight == 1.0:
        return components[0].reward
    return CombinedReward(components)


def _build_one(c: RewardComponentConfig, clients: dict[tuple[str, str | None], RewardClient],
               transport: httpx.AsyncBaseTransport | None) -> RewardFunction:
    if c.source == "env":
        return EnvReward()
    if c.source == "local":
        return LocalReward.from_target(str(c.function), c.kwargs or None, timeout_s=c.timeout_s,
                                       max_concurrency=c.max_concurrency)
    key = (str(c.url), c.token_env)
    if key not in clients:
        clients[key] = RewardClient(str(c.url), token=_token(c.token_env), token_env=c.token_env,
                                    request_timeout_s=c.request_timeout_s, connect_timeout_s=c.connect_timeout_s,
                                    request_deadline_s=c.request_deadline_s,
                                    retry=c.retry_policy(), max_concurrency=c.max_concurrency,
                                    max_batch_items=c.max_batch_items, micro_batching=c.micro_batching,
                                    batch_wait_s=c.batch_wait_s, transport=transport)
    return clients[key]


def _check_url(url: str) -> None:
    """Raise ValueError naming ``url`` unless it is ``http(s)://host[:port][/path]`` with a port in 1-65535."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"url {url!r} holds whitespace or a control character; percent-encode it (a space is %20)")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"url {url!r} is not a valid URL ({exc})") from None
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host; e.g. 'http://127.0.0.1:8001'")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"url {url!r}: the port {parts.netloc.rpartition(':')[2]!r} is not a number in 1-65535")


def _token(token_env: str | None) -> str | None:
    if token_env is None:
        return None
    value = os.environ.get(token_env, "")
    if not value:
        raise ConfigError(f"reward token_env={token_env!r}: environment variable {token_env!r} is unset or empty")
    return value
