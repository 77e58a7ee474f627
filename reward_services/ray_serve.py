"""The reward service as a Ray Serve deployment: same app, R replicas, restarts by Ray.

Each replica loads the user's function itself and serves the FastAPI app of
:func:`relax_agent.reward_services.server.create_app` through Serve's HTTP proxy, so clients
see the same ``/v1/reward`` and ``/healthz`` as with ``--runtime local``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from ray import serve

from relax_agent.errors import ConfigError
from relax_agent.reward_services.local import LocalReward, resolve_target
from relax_agent.reward_services.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_ITEMS, create_app, read_token

APP_NAME = "relax-reward"

# Serve's defaults give its HTTP proxy 5 s to report ready and 10 s per health check; on a busy
# CPU machine (the trainer and the rollout engine share the cores) the proxy misses them and Serve
# restarts it in a loop. These apply when this process starts Ray; a user's own values win.
PATIENT_PROXY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
                     "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


@serve.ingress()
class RewardDeployment:
    """One replica: loads ``target`` (with ``search_path`` on ``sys.path``) and serves it."""

    def __init__(self, target: str, search_path: str, token: str | None, options: dict[str, Any]):
        if search_path not in sys.path:
            sys.path.insert(0, search_path)
        self._reward = LocalReward.from_target(target, options.get("kwargs"), timeout_s=options["timeout_s"],
                                               max_concurrency=options["max_concurrency"])
        self._token, self._max_items, self._target = token, options["max_items"], target
        self._max_body_bytes = options.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self._reward, token=self._token, max_items=self._max_items,
                          max_body_bytes=self._max_body_bytes, title=f"reward service: {self._target}")


def build_app(target: str, *, replicas: int = 1, num_cpus_per_replica: float = 1.0, token: str | None = None,
              timeout_s: float = 30.0, max_concurrency: int = 64, max_items: int = DEFAULT_MAX_ITEMS,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, kwargs: dict[str, Any] | None = None) -> Any:
    """The bound Serve application (pass it to ``serve.run``).

    Raises:
        ConfigError: ``replicas < 1``.
    """
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    deployment = serve.deployment(
        RewardDeployment, name="reward", num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus_per_replica}, max_ongoing_requests=max(1, max_concurrency),
    )
    options = {"timeout_s": timeout_s, "max_concurrency": max_concurrency, "max_items": max_items,
               "max_body_bytes": max_body_bytes, "kwargs": kwargs}
    return deployment.bind(resolve_target(target), os.getcwd(), token, options)


def serve_ray(target: str, *, host: str = "127.0.0.1", port: int = 8001, replicas: int = 1,
              num_cpus: float | None = None, token_env: str | None = None, blocking: bool = True,
              **options: Any) -> None:
    """Start Ray (``num_cpus``, default ``replicas``), deploy the reward service, and block.

    With ``blocking=False`` it returns once the replicas are up; stop it with
    :func:`shutdown`. ``options`` are those of :func:`build_app`. When it starts Ray itself it
    gives Serve's HTTP proxy 30 s to report ready (:data:`PATIENT_PROXY_ENV`, unless set already).

    Raises:
        ConfigError: bad target (checked in this process first) or missing token variable.
    """
    import ray

    token = read_token(token_env) if token_env else None
    LocalReward.from_target(resolve_target(target), options.get("kwargs"))  # fail fast, before Ray starts
    if not ray.is_initialized():
        for name, value in PATIENT_PROXY_ENV.items():  # read by the Serve controller Ray starts below
            os.environ.setdefault(name, value)
        ray.init(num_cpus=num_cpus if num_cpus is not None else replicas, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(target, replicas=replicas, token=token, **options), name=APP_NAME, route_prefix="/")
    if not blocking:
        return
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def shutdown() -> None:
    """Stop Serve and the Ray instance this process started."""
    import ray

    serve.shutdown()
    ray.shutdown()
