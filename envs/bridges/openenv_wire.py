"""OpenEnv's wire protocol, spoken by :mod:`relax_agent.envs.bridges.openenv` with ``httpx`` and ``websockets``.

An openenv-core 0.3 server (``create_app`` / ``HTTPEnvServer``) answers ``GET /health`` and
``GET /schema`` (the JSON schemas of its Action, Observation and State models) over HTTP. Its HTTP
``POST /reset`` and ``POST /step`` build a fresh environment for every request and close it after
the call, so they cannot carry a multi-step episode: episodes go over the WebSocket ``/ws``, where
each connection is one *session* with its own environment instance (up to the server's
``max_concurrent_envs``; a connection beyond it is answered ``CAPACITY_REACHED`` and closed).
Messages are JSON: ``{"type": "reset", "data": {"seed": ...}}``, ``{"type": "step", "data":
<action fields>}``, ``{"type": "close"}``; answers ``{"type": "observation", "data":
{"observation": {...}, "reward": float | None, "done": bool}}`` or ``{"type": "error", "data":
{"message", "code"}}``.

:class:`Session` is one episode's connection: opened by :meth:`Session.open` (waiting, within
``session_wait_s``, for a free session slot), closed by :meth:`Session.close` from any thread.
Every call is bounded by ``timeout_s``; a dead, slow or refusing server is an :class:`EnvError`
naming its URL. Nothing here imports openenv-core.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from relax_agent.errors import ConfigError, EnvError

MAX_MESSAGE_BYTES = 64 * 2**20
"""Largest WebSocket message accepted from a server (observations may carry screenshots)."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ActionRefused(EnvError):
    """The server refused an action (``VALIDATION_ERROR``): the policy's fault, reported to it as an
    error observation; the session stays open."""


def base_url(url: str) -> str:
    """``url`` as an ``http(s)://`` base URL without a trailing slash (``ws(s)://`` accepted).

    Raises:
        ConfigError: not an http, https, ws or wss URL with a host.
    """
    parts = urlsplit(url.strip())
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"openenv URL {url!r}: expected http://HOST:PORT (or https://, ws://, wss://)")
    return f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (no proxy is used for it)."""
    return (urlsplit(url).hostname or "") in LOOPBACK


def http_get(url: str, path: str, timeout_s: float) -> Any:
    """``GET url+path`` as JSON, bounded by ``timeout_s``.

    Raises:
        EnvError: unreachable, slow, an HTTP error status or a body that is not JSON; names the URL.
    """
    import httpx

    try:
        res = httpx.get(f"{url}{path}", timeout=timeout_s, trust_env=not is_loopback(url))
        res.raise_for_status()
        return res.json()
    except httpx.TimeoutException as exc:
        raise EnvError(f"OpenEnv server {url} did not answer GET {path} within timeout_s={timeout_s}") from exc
    except (httpx.HTTPError, ValueError) as exc:
        raise EnvError(f"OpenEnv server {url}: GET {path} failed: {type(exc).__name__}: {exc}") from exc


def fetch_schema(url: str, timeout_s: float) -> dict[str, Any]:
    """The server's ``/schema`` (``{"action", "observation", "state"}`` JSON schemas).

    Raises:
        EnvError: as :func:`http_get`, or an answer without an ``action`` schema.
    """
    schema = http_get(url, "/schema", timeout_s)
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise EnvError(f"OpenEnv server {url}: GET /schema gave no action schema: {str(schema)[:300]}")
    return schema


def action_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """The action's fields, without openenv's own ``metadata``."""
    props = schema.get("properties") or {}
    return {k: v for k, v in props.items() if k != "metadata"}


def text_field_of(schema: dict[str, Any]) -> str | None:
    """The action's only field when it is a string (the reply's text goes there), else None."""
    fields = action_fields(schema)
    if len(fields) == 1:
        name, spec = next(iter(fields.items()))
        if isinstance(spec, dict) and spec.get("type") == "string":
            return name
    return None


def action_tool(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The OpenAI tool schema offering the action ``schema`` as tool ``name``: its fields are the
    parameters (``metadata`` left out), its docstring the description."""
    params: dict[str, Any] = {"type": "object", "properties": action_fields(schema),
                              "required": [r for r in schema.get("required", []) if r != "metadata"]}
    if schema.get("$defs"):
        params["$defs"] = schema["$defs"]
    title = schema.get("title") or "Action"
    description = schema.get("description") or f"Take one action ({title}) in the environment."
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def observation_text(observation: Any, fields: list[str] | None = None) -> str:
    """An observation's fields as a message text.

    With ``fields``: one field's value (a string as is, anything else as JSON), several as a JSON
    object. Without: the only string field as is (e.g. the echo env's ``echoed_message``; other
    fields are dropped), else every field as a JSON object with sorted keys.
    """
    obs = observation if isinstance(observation, dict) else {"observation": observation}
    if fields:
        picked = {k: obs.get(k) for k in fields}
        if len(fields) == 1:
            value = picked[fields[0]]
            return value if isinstance(value, str) else _json(value)
        return _json(picked)
    strings = [k for k, v in obs.items() if isinstance(v, str)]
    if len(strings) == 1:
        return obs[strings[0]]
    return _json(obs)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def reward_of(payload: dict[str, Any]) -> float:
    """A payload's reward as a finite float (None is 0.0).

    Raises:
        EnvError: a reward that is not a finite number.
    """
    value = payload.get("reward")
    if value is None:
        return 0.0
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"OpenEnv server sent a reward that is not a number: {value!r}") from exc
    if not math.isfinite(reward):
        raise EnvError(f"OpenEnv server sent a non-finite reward {reward!r}")
    return reward


class Session:
    """One episode's WebSocket session on an OpenEnv server.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        timeout_s: bound on connecting and on each answer.
        session_wait_s: how long :meth:`open` waits for a free session slot on a full server.
    """

    def __init__(self, url: str, timeout_s: float, session_wait_s: float) -> None:
        self.url = url
        self.ws_url = "ws" + url[len("http"):] + "/ws"
        self.timeout_s = timeout_s
        self.session_wait_s = session_wait_s
        self._ws: Any = None
        self._lock = threading.Lock()
        self.closed = False
        """Set by :meth:`close`: the session is over for good."""

    def open(self, reset_data: dict[str, Any]) -> dict[str, Any]:
        """Connect and reset; returns the reset payload (``{"observation", "reward", "done"}``).

        Raises:
            EnvError: cannot connect, no free session within ``session_wait_s``, a slow answer, a
                server error, or :meth:`close` called meanwhile; the session is closed.
        """
        deadline = time.monotonic() + self.session_wait_s
        pause = 0.1
        while True:
            if self.closed:
                raise EnvError(f"OpenEnv session on {self.url} was closed before it opened")
            self._connect()
            try:
                return self._call({"type": "reset", "data": reset_data}, "reset")
            except _Full as full:
                self._drop()
                if time.monotonic() + pause > deadline:
                    raise EnvError(f"OpenEnv server {self.url} had no free session for {self.session_wait_s}s "
                                   f"(session_wait_s): {full}") from None
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
            except BaseException:
                self._drop()
                raise

    def step(self, data: dict[str, Any]) -> dict[str, Any]:
        """Send one action; returns its payload.

        Raises:
            ActionRefused: the server refused the action's fields (the session stays open).
            EnvError: the session is gone, a slow answer or a server error (the session is closed).
        """
        try:
            return self._call({"type": "step", "data": data}, "step")
        except ActionRefused:
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Tell the server the session ends and close the connection; idempotent, callable from any
        thread (a call blocked on an answer then fails, and :meth:`open` stops waiting)."""
        with self._lock:
            self.closed = True
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(Exception):
            ws.send(json.dumps({"type": "close"}))
        with contextlib.suppress(Exception):
            ws.close()

    def _connect(self) -> None:
        try:
            from websockets.sync.client import connect
        except ImportError as exc:
            raise ConfigError(f"relax/OpenEnv-v0 needs the 'websockets' package to talk to {self.url}: "
                              f"pip install 'relax-agent[openenv]' ({exc})") from exc
        accepted = inspect.signature(connect).parameters  # websockets 12 .. 17
        kwargs: dict[str, Any] = {"proxy": None} if is_loopback(self.url) and "proxy" in accepted else {}
        if "legacy" in accepted:
            kwargs["legacy"] = True  # a plain connection that close() ends (websockets 17 warns otherwise)
        try:
            ws = connect(self.ws_url, open_timeout=self.timeout_s, close_timeout=min(self.timeout_s, 5.0),
                         ping_interval=None, max_size=MAX_MESSAGE_BYTES, **kwargs)
        except TimeoutError as exc:
            raise EnvError(f"OpenEnv server {self.url}: no WebSocket session at {self.ws_url} within "
                           f"timeout_s={self.timeout_s}") from exc
        except Exception as exc:  # noqa: BLE001 - OSError, InvalidHandshake, InvalidURI, ...
            raise EnvError(f"OpenEnv server {self.url}: cannot open a WebSocket session at {self.ws_url}: "
                           f"{type(exc).__name__}: {exc}") from exc
        with self._lock:
            if not self.closed:
                self._ws = ws
        if self._ws is not ws:
            with contextlib.suppress(Exception):
                ws.close()
            raise EnvError(f"OpenEnv session on {self.url} was closed while it opened")

    def _call(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        ws = self._ws
        if ws is None:
            raise EnvError(f"OpenEnv session on {self.url} is closed; reset() starts a new one")
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal may already wait to be read
                ws.send(json.dumps(message))
            raw = ws.recv(timeout=self.timeout_s)
        except TimeoutError as exc:
            raise EnvError(f"OpenEnv server {self.url} did not answer {what} within timeout_s={self.timeout_s}") from exc
        except ConnectionClosed as exc:
            raise EnvError(f"OpenEnv server {self.url} closed the session during {what}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a socket error
            raise EnvError(f"OpenEnv server {self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc
        try:
            answer = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise EnvError(f"OpenEnv server {self.url} answered {what} with something that is not JSON: "
                           f"{str(raw)[:200]}") from exc
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise EnvError(f"OpenEnv server {self.url} answered {what} without a data object: {str(answer)[:300]}")
        if answer.get("type") == "error":
            code, text = str(data.get("code", "UNKNOWN")), str(data.get("message", "unknown error"))
            if code == "CAPACITY_REACHED":
                raise _Full(text)
            if code == "VALIDATION_ERROR" and what == "step":
                errors = data.get("errors")
                raise ActionRefused(f"{text}: {_json(errors)}" if errors else text)
            raise EnvError(f"OpenEnv server {self.url}: {what} failed: {text} (code {code})")
        if answer.get("type") != "observation" or not isinstance(data.get("observation", {}), dict):
            raise EnvError(f"OpenEnv server {self.url} answered {what} with {str(answer)[:300]}")
        return data


class _Full(Exception):
    """The server answered CAPACITY_REACHED (every session slot is taken)."""


__all__ = ["ActionRefused", "LOOPBACK", "MAX_MESSAGE_BYTES", "Session", "action_fields", "action_tool", "base_url",
           "fetch_schema", "http_get", "is_loopback", "observation_text", "reward_of", "text_field_of"]
