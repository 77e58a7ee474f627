"""The ``runtime`` section of the run config: where the roles run (this process or Ray actors),
supervision and restarts, and the rollout-replica autoscaler.

:class:`~relax_agent.config.RelaxConfig` holds it as ``runtime``; its keys are documented where they
are declared.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from relax_agent.configbase import Section


class AutoscaleConfig(Section):
    """ray: scale rollout replicas while training from the trainer's idle time (``runtime.autoscale``).

    After each step the autoscaler takes the fraction of the step the trainer spent waiting for
    groups (``timing/data_wait_s / timing/step_s``), averaged over the last ``window_steps`` steps
    (the first step, which waits for the replicas' start and first rollouts, is not counted). Above
    ``scale_up_above`` rollout is the bottleneck: one more replica, up to ``max_replicas`` (and what
    the cluster holds, as for ``relax-agent scale``). Below ``scale_down_below`` the trainer is: the
    replicas wait at the staleness gate, one is drained, down to ``min_replicas``. After a change
    the next ``cooldown_steps`` steps are not judged (a new replica loads its model and pulls the
    weights first). A resumed run starts again from ``runtime.rollout_replicas``.
    """

    enabled: bool = False
    """Scale rollout replicas automatically (``runtime.kind: ray`` only; ``relax-agent scale`` still
    sets the target by hand, and the autoscaler goes on from there)."""
    min_replicas: int = Field(default=1, ge=1)
    """Fewest rollout replicas the autoscaler drains down to."""
    max_replicas: int | None = Field(default=None, ge=1)
    """Most rollout replicas the autoscaler starts; None: ``runtime.max_rollout_replicas`` (either way
    no more than the cluster's resources hold)."""
    scale_up_above: float = Field(default=0.25, ge=0.0, le=1.0)
    """Trainer idle fraction (mean over the window) above which a replica is added."""
    scale_down_below: float = Field(default=0.02, ge=0.0, le=1.0)
    """Trainer idle fraction (mean over the window) below which a replica is drained."""
    window_steps: int = Field(default=2, ge=1)
    """Steps whose idle fractions are averaged for a decision."""
    cooldown_steps: int = Field(default=2, ge=0)
    """Steps after a change that are not judged (the new replica's start, the drained one's exit)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscaleConfig:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"runtime.autoscale.min_replicas={self.min_replicas} is more than "
                             f"runtime.autoscale.max_replicas={self.max_replicas}")
        if self.scale_down_below >= self.scale_up_above:
            raise ValueError(f"runtime.autoscale.scale_down_below={self.scale_down_below:g} is not below "
                             f"runtime.autoscale.scale_up_above={self.scale_up_above:g}: the autoscaler would "
                             "add and drain replicas at the same idle time")
        return self


class RuntimeConfig(Section):
    """Where the roles run: this process (``local``) or Ray actors (``ray``).

    YAML ``runtime: ray`` is short for ``runtime: {kind: ray}``. With ``kind: ray`` every rollout
    replica (engine + envs + orchestrator) and the trainer are Ray actors; the data bus, the weight
    coordinator and the heartbeat table are named actors in ``data.ray_namespace``; Ray is started
    (``data.ray_num_cpus``) or joined (``data.ray_address``) like the Ray data bus. See
    :mod:`relax_agent.runtime.ray`.
    """

    kind: Literal["local", "ray"] = "local"
    """"local": every role in this process (the embedded default). "ray": Ray actors (mode async,
    weights.transport tcp)."""
    rollout_replicas: int = Field(default=1, ge=1)
    """ray: rollout replicas at start (change it while training with ``relax-agent scale``)."""
    max_rollout_replicas: int = Field(default=64, ge=1)
    """ray: most rollout replicas ``rollout_replicas`` and ``relax-agent scale`` may ask for (a scale
    beyond it, or beyond what the cluster's CPUs hold at ``rollout_num_cpus`` each beside the
    trainer, is refused with HTTP 422 naming the bound)."""
    max_groups_per_replica: int | None = Field(default=None, ge=1)
    """ray: most groups one replica plays at once (its env and sandbox capacity); None: no limit
    beyond the staleness gate."""
    rollout_num_cpus: float = Field(default=0.25, gt=0.0)
    """ray: CPUs Ray reserves per rollout replica (fractional: four replicas fit one core)."""
    trainer_num_cpus: float = Field(default=0.5, gt=0.0)
    """ray: CPUs Ray reserves for the trainer actor."""
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0)
    """ray: seconds between heartbeats a service sends from its own work loop."""
    heartbeat_timeout_s: float = Field(default=30.0, gt=0.0)
    """ray: a rollout replica whose last heartbeat is older than this is hung: killed and replaced. A
    trainer call during which the trainer process sends no heartbeat for twice this long (it beats
    every ``heartbeat_interval_s`` while a call runs) is a hang: the process is stopped or wedged
    (warned on the console at half of it; then killed and restarted as for
    ``trainer_hang_timeout_s``), caught in a minute instead of that bound's 30."""
    request_timeout_s: float | None = Field(default=None, gt=0.0)
    """ray: watchdog of one group on a replica; past it the replica is replaced and the group played
    again elsewhere. None: ``rollout.episode_timeout_s + 60``."""
    replica_start_timeout_s: float = Field(default=600.0, gt=0.0)
    """ray: seconds a new replica (or trainer) may take to load its model and pull the weights."""
    max_trainer_restarts: int = Field(default=3, ge=0)
    """ray: times a dead or hung trainer actor is restarted from the last checkpoint before the run
    fails (0: the first death or hang ends the run)."""
    trainer_hang_timeout_s: float | None = Field(default=1800.0, gt=0.0)
    """ray: a trainer call (an update with its publish, a save, a restart's replay: this bound per
    replayed update) still running after this many seconds is hung: said on the console and in the
    control endpoint's ``/status``, then the trainer actor is killed and restarted from the last
    checkpoint (counted against ``max_trainer_restarts``). Must exceed ``weights.publish_timeout_s``
    (a publish waits that long for slow replicas) plus the longest update. None: never."""
    drain_timeout_s: float = Field(default=600.0, gt=0.0)
    """ray: scale-in waits this long for a replica's groups to finish before it hands them back
    (kills the replica; the groups are played again elsewhere)."""
    control_port: int | None = Field(default=0, ge=0, le=65535)
    """ray: port of the controller's HTTP control endpoint on ``control_host`` (0: a free one; its URL
    and token go to ``run.output_dir/runtime.json`` for ``relax-agent scale``); None: no endpoint."""
    control_host: str = "127.0.0.1"
    """ray: address the control endpoint binds. Loopback: only this host can scale the run; another
    address (``0.0.0.0``: every interface, advertised as the driver's node address) lets hosts that
    can read ``runtime.json`` reach it. Every request needs the run's bearer token either way."""
    rollout_resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    """ray: Ray custom resources each rollout replica asks for (placement by node): hosts started with
    ``ray start --resources='{"rollout_host": 4}'`` take replicas when this is ``{"rollout_host": 0.01}``;
    empty: any node with CPUs."""
    rollout_spread: bool = False
    """ray: spread rollout replicas over the nodes that can take them (Ray's SPREAD scheduling) rather
    than packing them, so losing one host takes as few replicas as possible."""
    trainer_resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    """ray: Ray custom resources the trainer actor asks for, e.g. ``{"head_host": 0.01}`` to keep it on
    the head; empty: any node with CPUs."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """ray: scale rollout replicas from the trainer's idle time while training (off by default)."""

    @model_validator(mode="before")
    @classmethod
    def _from_kind(cls, value: Any) -> Any:
        # `runtime: ray` / `runtime=ray` names the kind alone.
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _replicas_within_bound(self) -> RuntimeConfig:
        if self.rollout_replicas > self.max_rollout_replicas:
            raise ValueError(f"runtime.rollout_replicas={self.rollout_replicas} is more than "
                             f"runtime.max_rollout_replicas={self.max_rollout_replicas}; raise the bound to run more")
        return self
