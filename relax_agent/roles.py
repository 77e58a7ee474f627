"""Builds the roles of a run from its config: tasks, policy, rollout engine, trainer, runner.

Checks that need no model run first (:func:`relax_agent.preflight.preflight`); the engine and
the trainer are whatever ``engine.kind`` and ``trainer.backend`` select (their sections'
``build``). With ``engine.kind: fake`` and ``trainer.backend: fake`` no model is loaded at all:
only the tokenizer, which the chat renderer needs.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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
    """``gymnasium.make(env_id, **kwargs)``.

    Raises:
        ConfigError: the env refused its arguments; a message that begins with one of ``kwargs``
            (``split='nope'; expected ...``) names it by its full key (``env.kwargs.split=...``).
    """
    import gymnasium

    import relax_agent.envs  # noqa: F401

    try:
        return gymnasium.make(env_id, **kwargs)
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
                on_tasks: Callable[[list[Task], list[Task]], None] | None = None, quiet: bool = False) -> Roles:
    """Preflight, then load the policy (from ``model_path`` when resuming) and build the roles.

    ``quiet``: print nothing (a Ray rollout replica: the driver already said it).

    ``on_tasks(train_tasks, heldout_tasks)`` (e.g. a check against a checkpoint) and then
    ``on_load(path)`` are called right before the policy starts loading.

    Raises:
        ConfigError, RewardServiceError, ModelLoadError: see :func:`~relax_agent.preflight.preflight`
            and :func:`~relax_agent.models.load_policy`.
    """
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser

    device = preflight(cfg)
    reward = build_checked_reward(cfg)
    owns_ray = train and start_data_bus(cfg)
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)
    model_cfg = cfg.model if model_path is None else cfg.model.model_copy(update={"path": str(model_path), "gguf_file": None})
    media = _media_policy(cfg, model_cfg)
    train_tasks, heldout_tasks = load_tasks(cfg, accepts_media=media)
    if train:
        check_task_counts(cfg, len(train_tasks))
    if on_tasks is not None:
        on_tasks(train_tasks, heldout_tasks)
    if on_load is not None:
        on_load(model_cfg.path)
    engine, trainer, tokenizer = _build_policy_roles(cfg, model_cfg, device, train, media)
    renderer = ChatRenderer(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, cfg.rollout.tool_example,
                            accepts_media=media)
    if not media and cfg.rollout.prompt_check_tasks:
        from relax_agent.preflight import check_prompt_budget

        k = cfg.rollout.prompt_check_tasks
        check_prompt_budget(make_env_factory(cfg), {"train": train_tasks[:k], "heldout": heldout_tasks[:k]},
                            renderer, cfg.rollout.max_total_tokens, cfg.run.seed)
    parser = build_parser(resolved_parser_name(cfg, tokenizer, model_cfg.path))
    if "auto" in (cfg.rollout.tool_parser, cfg.rollout.tools_in) and not quiet:
        import sys

        print(f"tools in: {renderer.describe_tools_in()}", file=sys.stderr, flush=True)
    driver = None
    if media:
        driver = _media_driver(cfg, model_cfg, engine, renderer, parser)
    elif cfg.rollout.driver == "agent":
        from relax_agent.rollout.agent_driver import AgentDriver

        driver = AgentDriver(make_env_factory(cfg), engine, renderer, parser, cfg.rollout.agent)
    runner = RolloutRunner(make_env_factory(cfg), engine, renderer, parser, rollout_limits(cfg), reward=reward,
                           env_id=cfg.env.id, driver=driver)
    return Roles(cfg, device, tokenizer, engine, trainer, runner, train_tasks, heldout_tasks, owns_ray)


def resolved_parser_name(cfg: RelaxConfig, tokenizer: Any, model_name: str) -> str:
    """``rollout.tool_parser``, with ``auto`` resolved from the tokenizer's chat template (or the model name);
    an ``auto`` choice is printed as one line, ``tool parser: NAME (why)``, on stderr.

    Raises:
        ConfigError: ``auto`` cannot tell the format (see
            :func:`~relax_agent.rollout.tool_parsers.auto.resolve_tool_parser`).
    """
    if cfg.rollout.tool_parser != "auto":
        return cfg.rollout.tool_parser
    import sys

    from relax_agent.rollout.tool_parsers import resolve_tool_parser

    name, why = resolve_tool_parser(tokenizer, cfg.rollout.tools_in, cfg.rollout.system_prompt, model_name)
    print(f"tool parser: {name} ({why})", file=sys.stderr, flush=True)
    return name


def _media_policy(cfg: RelaxConfig, model_cfg: Any) -> bool:
    """True for a multimodal policy (read from its config); ConfigError for settings that cannot serve one."""
    from relax_agent.errors import ConfigError
    from relax_agent.models import is_media_policy

    if not is_media_policy(model_cfg):
        return False
    if cfg.engine.kind != "hf":
        raise ConfigError(f"engine.kind={cfg.engine.kind!r}: a multimodal policy ({model_cfg.path}) rolls out on "
                          "engine.kind: hf (the media engine); set engine.kind: hf")
    if cfg.rollout.driver != "env":
        raise ConfigError(f"rollout.driver={cfg.rollout.driver!r}: a multimodal policy plays env-driven episodes; "
                          "set rollout.driver: env")
    if cfg.trainer.backend != "torch":
        raise ConfigError(f"trainer.backend={cfg.trainer.backend!r}: only the torch backend feeds media to the policy's "
                          "forward (another would train a blind model); set trainer.backend: torch")
    return True


def _media_driver(cfg: RelaxConfig, model_cfg: Any, engine: Any, renderer: Any, parser: Any) -> Any:
    """The env driver of a multimodal policy: media rendered, recorded and sent to the engine."""
    from relax_agent.models import load_media_processor
    from relax_agent.multimodal.driver import MediaEnvDriver
    from relax_agent.multimodal.render import MediaRenderer

    processor = load_media_processor(model_cfg, engine.model_config, max_image_pixels=cfg.rollout.max_image_pixels)
    return MediaEnvDriver(make_env_factory(cfg), engine, MediaRenderer(renderer, processor), parser)


def _build_policy_roles(cfg: RelaxConfig, model_cfg: Any, device: str, train: bool,
                        media: bool = False) -> tuple[Any, Any, Any]:
    """(engine, trainer or None, tokenizer); loads the policy only when a real engine or trainer needs it;
    a multimodal policy (``media``) rolls out on the media engine."""
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
    if media:
        from relax_agent.multimodal.engine import MediaEngine

        engine: Any = MediaEngine(engine_model, tokenizer, device=device, seed=cfg.run.seed,
                                  record_routes=cfg.moe.replay)
    else:
        engine = cfg.engine.build(model=engine_model, tokenizer=tokenizer, device=device, seed=cfg.run.seed,
                                  record_routes=cfg.moe.replay)
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

    return RolloutLimits(cfg.env.max_turns, cfg.rollout.max_total_tokens, cfg.env.step_timeout_s,
                         cfg.rollout.episode_timeout_s)
