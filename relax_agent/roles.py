"""Builds the roles of a run from its config: policy, engine, trainer, rollout runner, data.

Everything that can be checked without loading a model is checked first
(:func:`preflight`), so a typo in the config fails in milliseconds, naming the key.
"""

from __future__ import annotations

import copy
import difflib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from relax_agent.config import RelaxConfig
from relax_agent.errors import ConfigError, RewardServiceError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> str:
    """"auto" -> "cuda" when available else "cpu"; raises ConfigError for unavailable CUDA."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"run.device={name!r} but no CUDA device is available; use run.device=cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ConfigError(f"run.device={name!r}: expected auto, cpu or cuda[:N]")
    return name


def check_env_id(env_id: str) -> None:
    """Raise ConfigError (with close matches) when ``env_id`` is not registered.

    ``"pkg.module:ns/Name-v0"`` imports ``pkg.module`` first (from the working directory too,
    as ``python -m`` would), which registers the env.
    """
    import gymnasium

    import relax_agent.envs  # noqa: F401  (registers the built-in envs)

    module, _, name = env_id.rpartition(":")
    if module:
        import importlib
        import os
        import sys

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"env.id={env_id!r}: cannot import module {module!r}: {exc}") from exc
        env_id = name
    if env_id in gymnasium.registry:
        return
    close = difflib.get_close_matches(env_id, list(gymnasium.registry), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"env.id={env_id!r} is not a registered environment{hint} (see `relax-agent envs list`)")


def check_env_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    """Raise ConfigError naming an ``env.kwargs`` key the env's constructor does not take."""
    import inspect

    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    spec = gymnasium.spec(env_id.rpartition(":")[2])
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    params = inspect.signature(creator).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; {env_id} takes {sorted(accepted)}"
            raise ConfigError(f"env.kwargs.{key}: unknown argument of {env_id}{hint}")


def preflight(cfg: RelaxConfig) -> str:
    """Checks that need no model: parser name, env id, device, dtype per device. Returns the device."""
    from relax_agent.rollout.parsers import build_parser

    build_parser(cfg.rollout.tool_parser)
    check_env_id(cfg.env.id)
    check_env_kwargs(cfg.env.id, cfg.env.kwargs)
    device = resolve_device(cfg.run.device)
    check_dtypes(device, cfg.engine.dtype, cfg.trainer.dtype)
    check_mode(cfg, device)
    return device


def check_mode(cfg: RelaxConfig, device: str) -> None:
    """Refuse ``weights.transport: nccl`` in async mode (ConfigError naming it and the device);
    warn about ``weights`` / ``data`` keys that ``mode: colocate`` ignores.

    Async mode's engine shares the trainer's process, which nccl cannot reach (it broadcasts
    to rollout processes on CUDA GPUs); colocate copies weights in-process and uses no data bus.
    """
    if cfg.mode == "async" and cfg.weights.transport == "nccl":
        why = (f"run.device resolves to {device!r} and nccl needs CUDA GPUs" if not device.startswith("cuda") else
               "nccl reaches rollout engines in other processes, and this run's engine shares the trainer's process")
        raise ConfigError(f"weights.transport='nccl' with mode=async: {why}; use weights.transport=tcp or inproc")
    if cfg.mode == "colocate":
        ignored = _changed_keys("weights", cfg.weights) + _changed_keys("data", cfg.data)
        if ignored:
            warnings.warn(f"mode=colocate ignores {', '.join(ignored)}: colocate always copies weights to the "
                          "engine in-process and uses no data bus; these keys apply to mode=async", stacklevel=2)


def _changed_keys(section: str, value: Any) -> list[str]:
    """``section.key=value`` for each key of ``value`` that differs from its section's default."""
    default = type(value)().model_dump()
    return [f"{section}.{k}={v!r}" for k, v in value.model_dump().items() if v != default[k]]


def start_data_bus(cfg: RelaxConfig) -> bool:
    """Start (or connect to) Ray for ``data.backend: ray`` in async mode unless it runs already.

    Returns True when this call started it (``Roles.close`` shuts it down).
    Raises ConfigError: Ray could not start (see :func:`relax_agent.data.ray.start_ray`).
    """
    if cfg.mode != "async" or cfg.data.backend != "ray":
        return False
    from relax_agent.data.ray import start_ray

    return start_ray(cfg.data)


def check_dtypes(device: str, engine_dtype: str, trainer_dtype: str) -> None:
    """Refuse rollout / training dtypes the device cannot run (ConfigError naming the key).

    Checked by running the ops themselves (a matmul, softmax and attention in the dtype; for
    fp16 training also autocast and a loss scaler), not by a table: torch 2.13 on CPU runs all
    of fp32, bf16 and fp16 (fp16 matmul measured as fast as fp32 there), older builds lack fp16
    kernels; CUDA GPUs before Ampere lack bf16.
    """
    for key, dtype in (("engine.dtype", engine_dtype), ("trainer.dtype", trainer_dtype)):
        problem = _dtype_problem(device, dtype, training=key == "trainer.dtype")
        if problem:
            raise ConfigError(f"{key}={dtype} does not run on {device}: {problem}; use fp32"
                              + ("" if dtype == "bf16" else " or bf16"))


@functools.lru_cache(maxsize=None)
def _dtype_problem(device: str, dtype: str, training: bool) -> str | None:
    if dtype == "fp32":
        return None
    if dtype == "bf16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    try:
        x = torch.ones(2, 4, 8, device=device)
        if training:
            with torch.autocast(torch.device(device).type, dtype=_DTYPES[dtype]):
                torch.nn.functional.scaled_dot_product_attention(x, x, x @ torch.ones(8, 8, device=device)).sum()
            if dtype == "fp16":
                torch.amp.GradScaler(torch.device(device).type)
        else:
            h = x.to(_DTYPES[dtype])
            torch.softmax(torch.nn.functional.scaled_dot_product_attention(h, h, h @ h.transpose(1, 2) @ h), -1)
    except (RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def make_env_factory(cfg: RelaxConfig) -> Any:
    import gymnasium

    import relax_agent.envs  # noqa: F401

    return functools.partial(gymnasium.make, cfg.env.id, **cfg.env.kwargs)


@dataclass
class Roles:
    """The live objects of a run."""

    cfg: RelaxConfig
    device: str
    model: Any
    tokenizer: Any
    engine: Any
    trainer: Any
    runner: Any
    train_tasks: list[dict[str, Any]]
    heldout_tasks: list[dict[str, Any]]
    owns_ray: bool = False
    """The run started Ray for the data bus (``data.backend: ray``); ``close`` shuts it down."""

    def close(self) -> None:
        self.engine.close()
        if self.runner.reward is not None:
            import asyncio

            asyncio.run(self.runner.reward.aclose())
        if self.owns_ray:
            import ray

            ray.shutdown()


def load_tasks(cfg: RelaxConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) task lists of the configured env."""
    env = make_env_factory(cfg)()
    try:
        inner = env.unwrapped
        return inner.tasks("train"), inner.tasks("heldout")
    finally:
        env.close()


def build_roles(cfg: RelaxConfig, model_path: str | Path | None = None, train: bool = True,
                on_load: Callable[[str], None] | None = None,
                on_tasks: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None) -> Roles:
    """Load the policy (from ``model_path`` when resuming) and build engine, trainer and runner.

    Checks that need no model (config, env id, reward service and its token, task counts) run
    first; ``on_tasks(train_tasks, heldout_tasks)`` (e.g. a check against a checkpoint) and then
    ``on_load(path)`` are called right before the policy starts loading.
    """
    from relax_agent.models import load_policy
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.engines.hf import HFEngine
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.runner import RolloutRunner

    device = preflight(cfg)
    reward = build_checked_reward(cfg)
    owns_ray = train and start_data_bus(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    train_tasks, heldout_tasks = load_tasks(cfg)
    if train:
        check_task_counts(cfg, len(train_tasks))
    if on_tasks is not None:
        on_tasks(train_tasks, heldout_tasks)
    model_cfg = cfg.model if model_path is None else cfg.model.model_copy(update={"path": str(model_path), "gguf_file": None})
    if on_load is not None:
        on_load(model_cfg.path)
    model, tokenizer = load_policy(model_cfg, dtype="fp32" if train else cfg.engine.dtype, device=device)
    engine_model = copy.deepcopy(model).to(_DTYPES[cfg.engine.dtype]) if train else model
    engine = HFEngine(engine_model, tokenizer, cfg.engine, device=device, seed=cfg.run.seed,
                      record_routes=cfg.moe.replay)
    trainer = _build_trainer(cfg, model, device) if train else None
    renderer = ChatRenderer(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, cfg.rollout.tool_example)
    limits = rollout_limits(cfg)
    runner = RolloutRunner(make_env_factory(cfg), engine, renderer, build_parser(cfg.rollout.tool_parser), limits,
                           reward=reward, env_id=cfg.env.id)
    return Roles(cfg, device, model, tokenizer, engine, trainer, runner, train_tasks, heldout_tasks, owns_ray)


def rollout_limits(cfg: RelaxConfig) -> Any:
    """The per-episode :class:`~relax_agent.rollout.runner.RolloutLimits` of ``cfg`` (env and rollout keys)."""
    from relax_agent.rollout.runner import RolloutLimits

    return RolloutLimits(cfg.env.max_turns, cfg.rollout.max_total_tokens, cfg.env.step_timeout_s)


def check_task_counts(cfg: RelaxConfig, num_train_tasks: int) -> None:
    """Raise ConfigError when one step asks for more distinct tasks than the train split holds."""
    if cfg.rollout.tasks_per_step > num_train_tasks:
        raise ConfigError(
            f"rollout.tasks_per_step={cfg.rollout.tasks_per_step} is more than the {num_train_tasks} train tasks "
            f"of env.id={cfg.env.id!r}; set rollout.tasks_per_step <= {num_train_tasks}"
        )


REWARD_STARTUP_TIMEOUT_S = 15.0
"""How long the start-up check waits for a remote reward service (it may still be starting)."""


def build_checked_reward(cfg: RelaxConfig) -> Any:
    """The configured reward, checked once (a wrong URL or token fails here); None for the env's own."""
    import asyncio

    from relax_agent.reward_services import build_reward, check_reward
    from relax_agent.rollout.rewarding import needs_scoring

    if not needs_scoring(cfg.reward):
        return None
    reward = build_reward(cfg.reward)
    try:
        asyncio.run(asyncio.wait_for(check_reward(reward), REWARD_STARTUP_TIMEOUT_S))
    except asyncio.TimeoutError:
        urls = [c.url for c in cfg.reward.components if c.source == "remote"]
        raise RewardServiceError(
            f"reward service {', '.join(map(str, urls))} did not answer its start-up check within "
            f"{REWARD_STARTUP_TIMEOUT_S:.0f} s; is it running? (reward.url)"
        ) from None
    return reward


def _build_trainer(cfg: RelaxConfig, model: Any, device: str) -> Any:
    from relax_agent.train.backends.torch_backend import TorchTrainer

    ref_model = None
    if cfg.trainer.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
    return TorchTrainer(model, cfg.trainer, device=device, ref_model=ref_model, temperature=cfg.rollout.temperature,
                        routing_replay=cfg.moe.replay)
