"""``relax-agent serve-reward``: turn a Python function into a reward service.

    relax-agent serve-reward examples.custom_reward.reward:score --port 8001
    relax-agent serve-reward path/to/file.py:score --token-env REWARD_TOKEN --workers 4
    relax-agent serve-reward my_pkg.rewards:score --runtime ray --replicas 4
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any

import typer

from relax_agent.errors import ConfigError


class Runtime(str, Enum):
    """Where the service runs."""

    local = "local"
    ray = "ray"


def serve_reward(
    target: Annotated[str, typer.Argument(help="The reward function: module:function or path/to/file.py:function.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)] = 8001,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes (--runtime local).")] = 1,
    token_env: Annotated[str | None, typer.Option(help="Environment variable holding the bearer token clients must send.")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Deadline per item, seconds (per call for a batched function).")] = 30.0,
    max_concurrency: Annotated[int, typer.Option(help="Items scored at once per worker (threads for a sync function).")] = 64,
    max_items: Annotated[int, typer.Option(help="Most items accepted in one request.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted, bytes (larger: HTTP 413).",
                                                min=1)] = 64 * 2**20,
    kwargs: Annotated[str | None, typer.Option(help="JSON object: arguments for a factory target (a class).")] = None,
    runtime: Annotated[Runtime, typer.Option(help="local: uvicorn; ray: a Ray Serve deployment.")] = Runtime.local,
    replicas: Annotated[int, typer.Option(help="Ray Serve replicas (--runtime ray).")] = 1,
    num_cpus: Annotated[float | None, typer.Option(help="CPUs Ray starts with (--runtime ray; default: replicas).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve a Python reward function over HTTP (POST /v1/reward, GET /healthz). A non-loopback
    ``--host`` needs ``--token-env`` (refused otherwise)."""
    try:
        from relax_agent.netaddr import check_listener

        check_listener("--host", host, authenticated=token_env is not None)  # never an open scorer off loopback
        factory_kwargs = _parse_kwargs(kwargs)
        options: dict[str, Any] = {"timeout_s": timeout_s, "max_concurrency": max_concurrency,
                                   "max_items": max_items, "max_body_bytes": max_body_bytes, "kwargs": factory_kwargs}
        if runtime is Runtime.ray:
            if workers != 1:
                raise ConfigError("--workers applies to --runtime local; use --replicas with --runtime ray")
            from relax_agent.reward_services.ray_serve import serve_ray

            serve_ray(target, host=host, port=port, replicas=replicas, num_cpus=num_cpus, token_env=token_env, **options)
        else:
            if replicas != 1:
                raise ConfigError("--replicas applies to --runtime ray; use --workers with --runtime local")
            from relax_agent.reward_services.server import serve

            serve(target, host=host, port=port, workers=workers, token_env=token_env, log_level=log_level, **options)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None


def _parse_kwargs(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kwargs must be a JSON object, got {raw!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--kwargs must be a JSON object, got {type(value).__name__}")
    return value


if __name__ == "__main__":
    typer.run(serve_reward)
