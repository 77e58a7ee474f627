"""Builds the roles of a run from its config: tasks, policy, rollout engine, trainer, runner.

Checks that need no model run first (:func:`relax_agent.preflight.preflight`); the engine and
the trainer are whatever ``engine.kind`` and ``trainer.backend`` select (their sections'
``build``). With ``engine.kind: fake`` and ``trainer.backend: fake`` no model is loaded at all:
only the tokenizer, which the chat renderer needs.

Under ``runtime.kind: ray`` each process builds what it runs: the driver only the checks, the tasks
and the tokenizer (:func:`build_driver_roles`), each rollout replica its engine and envs
(:func:`build_roles` with ``checked=True``), the trainer actor its trainer
(:mod:`relax_agent.runtime.ray_trainer`). :func:`build_run_roles` picks for a training run.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_agent.config import RelaxConfig
from relax_agent.errors import ConfigError
from relax_agent.preflight import build_checked_reward, check_task_counts, preflight
from relax_agent.rollout.engines.base import InferenceEngine
from relax_agent.rollout.runner import RolloutRunner
from relax_agent.train.backends.base import Trainer

Task = dict[str, Any]


def make_env_factory(cfg: RelaxConfig) -> Callable[[], Any]:
    """A function that builds a fresh env of ``cfg.env`` (:func:`make_env`)."""
    return functools.partial(make_env, cfg.env.id, dict(cfg.env.kwargs))


def make_env(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``relax_agent.envs.make(env_id, **kwargs)`` (a bridge's ``"<scheme>:<name>"`` included).

    Raises:
        ConfigError: the env refused its arguments; a message that begins with one of ``kwargs``
            (``split='nope'; expected ...``) names it by its full key (``env.kwargs.split=...``).
    """
    from relax_agent.envs import make

    try:
        return make(env_id, **kwargs)
    except ConfigError as exc:
        message = str(exc)
        if any(re.match(rf"{re.escape(key)}\b", message) for key in kwargs):
            raise ConfigError(f"env.kwargs.{message} (env.id={env_id!r})") from exc
        raise


@dataclass
class Roles:
    """The live objects of a run (the local runtime wraps them into services).

    Attributes:
        tokenizer: the policy's tokenizer (rollout dumps decode responses with it).
        engine: the rollout engine (its own copy of the policy).
        trainer: the trainer; None for evaluation-only roles.
        runner: plays episodes of the env against the engine.
        train_tasks / heldout_tasks: the env's splits.
        owns_ray: the run started Ray for the data bus; :meth:`close` shuts it down.
    """

    cfg: RelaxConfig
    device: str
    tokenizer: Any
    engine: InferenceEngine
    trainer: Trainer | None
    runner: RolloutRunner
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    owns_ray: bool = False

    def close(self) -> None:
        """Close the engine, the reward client, and Ray when this run started it."""
        self.engine.close()
        if self.runner.reward is not None:
            import asyncio

            asyncio.run(self.runner.reward.aclose())
        if self.owns_ray:
            import ray

            ray.shutdown()


def load_tasks(cfg: RelaxConfig, accepts_media: bool = False) -> tuple[list[Task], list[Task]]:
    """(train, held-out) task lists of the configured env; the first train task's opening
    messages are checked against the policy (see :func:`relax_agent.preflight.check_env_prompt`;
    ``accepts_media``: the policy is multimodal)."""
    from relax_agent.preflight import check_env_prompt

    env = make_env_factory(cfg)()
    try:
        inner = env.unwrapped
        train, heldout = inner.tasks("train"), inner.tasks("heldout")
        if train:
            check_env_prompt(env, train[0], cfg.run.seed, accepts_media)
        return train, heldout
    finally:
        env.close()


def start_data_bus(cfg: RelaxConfig) -> bool:
    """Start (or connect to) Ray for ``data.backend: ray`` unless it runs already.

    Returns True when this call started it (``Roles.close`` shuts it down).
    Raises ConfigError: Ray could not start (see :func:`relax_agent.data.ray.start_ray`).
    """
    if cfg.data.backend != "ray":
        return False
    from relax_agent.data.ray import start_ray

    return start_ray(cfg.data)


def build_roles(cfg: RelaxConfig, model_path: str | Path | None = None, train: bool = True,
                on_load: Callable[[str], None] | None = None,
                on_tasks: Callable[[list[Task], list[Task]], None] | None = None, quiet: bool = False,
                checked: bool = False) -> Roles:
    """Preflight, then load the policy (from ``model_path`` when resuming) and build the roles.

    ``quiet``: print nothing (a Ray rollout replica: the driver already said it). ``checked``: the
    driver ran the checks already (:func:`build_driver_roles`): no preflight, no reward start-up
    check, no task lists (a replica is handed its tasks), no prompt-budget check.

    ``on_tasks(train_tasks, heldout_tasks)`` (e.g. a check against a checkpoint) and then
    ``on_load(path)`` are called right before the policy starts loading.

    Raises:
        ConfigError, RewardServiceError, ModelLoadError: see :func:`~relax_agent.preflight.preflight`
            and :func:`~relax_agent.models.load_policy`.
    """
    from relax_agent.preflight import resolve_device
    from relax_agent.reward_services import build_reward
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.rewarding import needs_scoring

    device = resolve_device(cfg.run.device) if checked else preflight(cfg)
    if checked:
        reward = build_reward(cfg.reward) if needs_scoring(cfg.reward) else None
    else:
        reward = build_checked_reward(cfg)
    owns_ray = train and start_data_bus(cfg)
    _set_threads(cfg)
    model_cfg = _model_config(cfg, model_path)
    media = _media_policy(cfg, model_cfg)
    train_tasks, heldout_tasks = ([], []) if checked else load_tasks(cfg, accepts_media=media)
    if train and not checked:
        check_task_counts(cfg, len(train_tasks))
    if on_tasks is not None:
        on_tasks(train_tasks, heldout_tasks)
    if on_load is not None:
        on_load(model_cfg.path)
    engine, trainer, tokenizer = _build_policy_roles(cfg, model_cfg, device, train)
    renderer = ChatRenderer(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, cfg.rollout.tool_example,
                            accepts_media=media)
    if not media and not checked:
        _check_prompts(cfg, renderer, train_tasks, heldout_tasks)
    parser = build_parser(resolved_parser_name(cfg, tokenizer, model_cfg.path, quiet))
    if not quiet:
        _say_tools_in(cfg, renderer)
    driver = None
    if media:
        driver = _media_driver(cfg, model_cfg, engine, renderer, parser)
    elif cfg.rollout.driver == "agent":
        from relax_agent.rollout.agent_driver import AgentDriver

        driver = AgentDriver(make_env_factory(cfg), engine, renderer, parser, cfg.rollout.agent)
    runner = RolloutRunner(make_env_factory(cfg), engine, renderer, parser, rollout_limits(cfg), reward=reward,
                           env_id=cfg.env.id, driver=driver)
    return Roles(cfg, device, tokenizer, engine, trainer, runner, train_tasks, heldout_tasks, owns_ray)


@dataclass
class DriverRoles:
    """What the driver of a ``runtime: ray`` training run holds: no engine, no trainer, no weights.

    The rollout replicas and the trainer actor build their own engine and trainer where they run
    (:func:`build_roles` with ``checked=True`` in each replica, the trainer actor's own loader);
    the driver keeps the task splits, the tokenizer (rollout dumps decode responses with it) and
    the episode limits, from which it makes episode specs.

    Attributes:
        train_tasks / heldout_tasks: the env's splits.
        limits: per-episode limits (:func:`rollout_limits`).
    """

    cfg: RelaxConfig
    tokenizer: Any
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    limits: Any

    def specs(self, tasks: list[Task], group_size: int, prefix: str, seed: int) -> list[Any]:
        """Episode specs (:func:`~relax_agent.rollout.runner.episode_specs`) under :attr:`limits`."""
        from relax_agent.rollout.runner import episode_specs

        return episode_specs(tasks, group_size, prefix, seed, self.limits)

    def close(self) -> None:
        """Nothing to close: the driver holds no engine, reward client or Ray session of its own."""


def build_driver_roles(cfg: RelaxConfig, model_path: str | Path | None = None,
                       on_tasks: Callable[[list[Task], list[Task]], None] | None = None) -> DriverRoles:
    """The driver's side of a ``runtime: ray`` training run: every check that needs no weights, run once
    here (preflight, the reward service's start-up check, the env's prompt against the policy's
    chat template, the prompt budget, the tool parser's resolution), then the tasks and the
    tokenizer. No model is loaded in this process.

    Raises:
        ConfigError, RewardServiceError: see :func:`~relax_agent.preflight.preflight` and
            :func:`~relax_agent.preflight.build_checked_reward`.
    """
    import asyncio

    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser

    preflight(cfg)
    reward = build_checked_reward(cfg)  # checked here, once; each replica builds its own client
    if reward is not None:
        asyncio.run(reward.aclose())
    model_cfg = _model_config(cfg, model_path)
    media = _media_policy(cfg, model_cfg)
    train_tasks, heldout_tasks = load_tasks(cfg, accepts_media=media)
    check_task_counts(cfg, len(train_tasks))
    if on_tasks is not None:
        on_tasks(train_tasks, heldout_tasks)
    tokenizer = load_tokenizer(model_cfg)
    renderer = ChatRenderer(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, cfg.rollout.tool_example,
                            accepts_media=media)
    if not media:
        _check_prompts(cfg, renderer, train_tasks, heldout_tasks)
    build_parser(resolved_parser_name(cfg, tokenizer, model_cfg.path))
    _say_tools_in(cfg, renderer)
    return DriverRoles(cfg, tokenizer, train_tasks, heldout_tasks, rollout_limits(cfg))


def build_run_roles(cfg: RelaxConfig, model_path: str | Path | None = None,
                    on_load: Callable[[str], None] | None = None,
                    on_tasks: Callable[[list[Task], list[Task]], None] | None = None) -> Roles | DriverRoles:
    """The roles a training run's process builds: :func:`build_driver_roles` under ``runtime.kind: ray``
    (the actors load the policy), :func:`build_roles` otherwise (``on_load(path)`` before the policy loads).

    Raises:
        ConfigError, RewardServiceError, ModelLoadError: see :func:`build_roles`.
    """
    if cfg.runtime.kind == "ray":
        return build_driver_roles(cfg, model_path, on_tasks)
    return build_roles(cfg, model_path, on_load=on_load, on_tasks=on_tasks)


def resolved_parser_name(cfg: RelaxConfig, tokenizer: Any, model_name: str, quiet: bool = False) -> str:
    """``rollout.tool_parser``, with ``auto`` resolved from the tokenizer's chat template (or the model name);
    an ``auto`` choice is printed as one line, ``tool parser: NAME (why)``, on stderr (not when ``quiet``).

    Raises:
        ConfigError: ``auto`` cannot tell the format (see
            :func:`~relax_agent.rollout.tool_parsers.auto.resolve_tool_parser`).
    """
    if cfg.rollout.tool_parser != "auto":
        return cfg.rollout.tool_parser
    import sys

    from relax_agent.rollout.tool_parsers import resolve_tool_parser

    name, why = resolve_tool_parser(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, model_name)
    if not quiet:
        print(f"tool parser: {name} ({why})", file=sys.stderr, flush=True)
    return name


def _set_threads(cfg: RelaxConfig) -> None:
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)


def _model_config(cfg: RelaxConfig, model_path: str | Path | None) -> Any:
    """``cfg.model``, or a copy that loads ``model_path`` (a checkpoint's ``model`` folder, resuming)."""
    if model_path is None:
        return cfg.model
    return cfg.model.model_copy(update={"path": str(model_path), "gguf_file": None})


def _check_prompts(cfg: RelaxConfig, renderer: Any, train_tasks: list[Task], heldout_tasks: list[Task]) -> None:
    """The first ``rollout.prompt_check_tasks`` prompts of each split fit ``rollout.max_total_tokens``."""
    if not cfg.rollout.prompt_check_tasks:
        return
    from relax_agent.preflight import check_prompt_budget

    k = cfg.rollout.prompt_check_tasks
    check_prompt_budget(make_env_factory(cfg), {"train": train_tasks[:k], "heldout": heldout_tasks[:k]},
                        renderer, cfg.rollout.max_total_tokens, cfg.run.seed)


def _say_tools_in(cfg: RelaxConfig, renderer: Any) -> None:
    """Print how tools reach the prompt (``tools in: ...``) when ``auto`` chose it."""
    if "auto" in (cfg.rollout.tool_parser, cfg.rollout.tools_in):
        import sys

        print(f"tools in: {renderer.describe_tools_in()}", file=sys.stderr, flush=True)


def _media_policy(cfg: RelaxConfig, model_cfg: Any) -> bool:
    """True for a multimodal policy (read from its config); ConfigError for settings that cannot serve one."""
    from relax_agent.errors import ConfigError
    from relax_agent.models import is_media_policy

    if not is_media_policy(model_cfg):
        return False
    if cfg.engine.kind != "hf":
        raise ConfigError(f"engine.kind={cfg.engine.kind!r}: a multimodal policy ({model_cfg.path}) rolls out on "
                          "engine.kind: hf (its HF engine serves media requests); set engine.kind: hf")
    if cfg.rollout.driver != "env":
        raise ConfigError(f"rollout.driver={cfg.rollout.driver!r}: a multimodal policy plays env-driven episodes; "
                          "set rollout.driver: env")
    if cfg.rollout.context.policy != "truncate":
        raise ConfigError(f"rollout.context.policy={cfg.rollout.context.policy!r}: a multimodal policy's episodes end at a "
                          "full context (a new context would have to carry the media again); set rollout.context.policy: "
                          "truncate")
    if cfg.trainer.backend != "torch":
        raise ConfigError(f"trainer.backend={cfg.trainer.backend!r}: only the torch backend feeds media to the policy's "
                          "forward (another would train a blind model); set trainer.backend: torch")
    return True


def _media_driver(cfg: RelaxConfig, model_cfg: Any, engine: Any, renderer: Any, parser: Any) -> Any:
    """The env driver of a multimodal policy: media rendered, recorded and sent to the engine."""
    from relax_agent.models import load_media_processor
    from relax_agent.multimodal.render import MediaRenderer
    from relax_agent.rollout.env_driver import EnvDriver

    processor = load_media_processor(model_cfg, engine.model_config, max_image_pixels=cfg.rollout.max_image_pixels,
                                     max_video_frames=cfg.rollout.max_video_frames)
    return EnvDriver(make_env_factory(cfg), engine, MediaRenderer(renderer, processor), parser)


def _build_policy_roles(cfg: RelaxConfig, model_cfg: Any, device: str, train: bool) -> tuple[Any, Any, Any]:
    """(engine, trainer or None, tokenizer); loads the policy only when a real engine or trainer needs it;
    a multimodal policy rolls out on the HF engine, which serves it unbatched with media."""
    from relax_agent.models import load_policy, load_tokenizer

    needs_model = cfg.engine.kind != "fake" or (train and cfg.trainer.backend != "fake")
    if not needs_model:
        tokenizer = load_tokenizer(model_cfg)
        trainer = cfg.trainer.build() if train else None
        return cfg.engine.build(tokenizer=tokenizer), trainer, tokenizer
    model, tokenizer = load_policy(model_cfg, dtype="fp32" if train else cfg.engine.dtype, device=device)
    engine_model = None
    if cfg.engine.kind != "fake":
        from relax_agent.models import torch_dtype

        engine_model = copy.deepcopy(model).to(torch_dtype(cfg.engine.dtype)) if train else model
    engine = cfg.engine.build(model=engine_model, tokenizer=tokenizer, device=device, seed=cfg.run.seed,
                              record_routes=cfg.moe.replay)  # a multimodal policy's HF engine serves it unbatched
    trainer = None
    if train:
        if cfg.trainer.lora.enabled and model_cfg is not cfg.model:
            # a resume: the engine serves the checkpoint's merged weights; the trainer rebuilds the adapter
            # (from its state) over the original base, as it was trained
            model, _ = load_policy(cfg.model, dtype="fp32", device=device)
        trainer = cfg.trainer.build(model=model, device=device, temperature=cfg.rollout.temperature,
                                    routing_replay=cfg.moe.replay)
    return engine, trainer, tokenizer


def rollout_limits(cfg: RelaxConfig) -> Any:
    """The per-episode :class:`~relax_agent.rollout.runner.RolloutLimits` of ``cfg`` (env and rollout keys)."""
    from relax_agent.rollout.runner import RolloutLimits

    context = cfg.rollout.context if cfg.rollout.context.policy != "truncate" else None
    return RolloutLimits(cfg.env.max_turns, cfg.rollout.max_total_tokens, cfg.env.step_timeout_s,
                         cfg.rollout.episode_timeout_s, context)
