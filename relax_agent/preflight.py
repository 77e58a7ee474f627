"""Every check of a run that needs no model: config combinations, env id and kwargs, device
and dtypes, task counts, the reward service and its token.

A typo in a config fails here in milliseconds, naming the key, before a policy loads.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from typing import Any

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
    as ``python -m`` would), which registers the env. A bridge's ``"<scheme>:<name>"``
    (:mod:`relax_agent.envs.bridges`) needs its foreign package installed.
    """
    import gymnasium

    from relax_agent.envs import resolve_id
    from relax_agent.envs.bridges import require, split_scheme

    bridge, _ = split_scheme(env_id)
    if bridge is not None and bridge.package is not None:
        require(bridge.scheme)
    try:
        name, _ = resolve_id(env_id)
    except ImportError as exc:
        module = env_id.rpartition(":")[0]
        raise ConfigError(f"env.id={env_id!r}: cannot import module {module!r}: {exc}") from exc
    if name in gymnasium.registry:
        return
    close = difflib.get_close_matches(name, list(gymnasium.registry), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"env.id={env_id!r} is not a registered environment{hint} (see `relax-agent envs list`)")


def check_env_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    """Raise ConfigError naming an ``env.kwargs`` key the env's constructor does not take (or an env
    registered without an ``entry_point``)."""
    import inspect

    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    from relax_agent.envs import resolve_id

    name, kwargs = resolve_id(env_id, kwargs)
    spec = gymnasium.spec(name)
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    if creator is None:
        raise ConfigError(f"env.id={env_id!r} has no entry_point (a vector-only env)")
    params = inspect.signature(creator).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; {name} takes {sorted(accepted)}"
            raise ConfigError(f"env.kwargs.{key}: unknown argument of {name}{hint}")


def preflight(cfg: RelaxConfig) -> str:
    """Checks that need no model: parser name, env id, device, dtype per device. Returns the device."""
    from relax_agent.rollout.parsers import build_parser

    if cfg.rollout.tool_parser != "auto":  # auto is resolved from the tokenizer, once the policy loads
        build_parser(cfg.rollout.tool_parser)
    check_env_id(cfg.env.id)
    check_env_kwargs(cfg.env.id, cfg.env.kwargs)
    device = resolve_device(cfg.run.device)
    check_dtypes(device, cfg.engine.dtype, cfg.trainer.dtype)
    check_vllm_engine(cfg)
    check_mode(cfg, device)
    check_output_dir(cfg.run.output_dir)
    return device


def check_env_prompt(env: Any, task: dict[str, Any], seed: int, accepts_media: bool = False) -> None:
    """Reset ``env`` on ``task`` and refuse its opening messages when they carry media parts the
    policy cannot take (ConfigError naming the message and part type; a text-only policy would
    otherwise see the images dropped). An env whose reset fails here is left to fail as an
    episode, with its cause, when the run plays it."""
    from relax_agent.rollout.chat import check_media

    try:
        obs, _ = env.reset(seed=seed, options={"task": task})
    except Exception:  # the episode records the env's own failure with its cause
        return
    if isinstance(obs, (list, tuple)):
        check_media([m for m in obs if isinstance(m, dict)], accepts_media, where="env.reset observation")


def check_prompt_budget(make_env: Any, splits: dict[str, list[dict[str, Any]]], renderer: Any,
                        max_total_tokens: int, seed: int) -> None:
    """Refuse a task whose rendered opening prompt alone fills ``rollout.max_total_tokens``.

    Such an episode samples no token (its budget is used up before the first turn) and trains
    nothing. ``splits`` maps a split name ("train", "heldout") to the tasks to check; each is
    reset in one env from ``make_env`` and rendered with ``renderer`` (a
    :class:`~relax_agent.rollout.chat.ChatRenderer`). A reset or render that fails is skipped:
    the episode records that failure with its cause when the run plays it.

    Raises:
        ConfigError: names the task, its prompt's token count and ``rollout.max_total_tokens``.
    """
    env = make_env()
    try:
        for split, tasks in splits.items():
            for task in tasks:
                try:
                    obs, info = env.reset(seed=seed, options={"task": task})
                    tools = info.get("tools", ()) if isinstance(info, dict) else ()
                    n = len(renderer.render_prompt(obs, tools).token_ids)
                except Exception:  # noqa: BLE001  (the episode records its own failure)
                    continue
                if n >= max_total_tokens:
                    raise ConfigError(
                        f"rollout.max_total_tokens={max_total_tokens} leaves no room for a reply: the opening prompt "
                        f"of {split} task {task.get('id', '?')!r} alone is {n} tokens, so its episodes would sample "
                        f"nothing and train nothing; set rollout.max_total_tokens above {n} (e.g. {n} + "
                        "rollout.max_new_tokens) or shorten the prompt")
    finally:
        env.close()


def check_vllm_engine(cfg: RelaxConfig) -> None:
    """``engine.kind: vllm``: its venv exists (``engine.vllm.python``) and ``engine.vllm.weights_dir``
    is a writable folder; ConfigError naming the key otherwise. Routing replay
    (``moe.routing_replay: rollout``) is checked when the server starts: the model's routers and
    whether this vLLM can capture routes (:class:`~relax_agent.rollout.engines.vllm_engine.VLLMEngine`)."""
    if cfg.engine.kind != "vllm":
        return
    import os

    from relax_agent.rollout.engines.vllm_engine import find_vllm_python

    find_vllm_python(cfg.engine.vllm.python)
    folder = cfg.engine.vllm.weights_dir
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise ConfigError(f"engine.vllm.weights_dir={folder!r} is not a writable folder; the vLLM engine writes "
                          "its model and each weight version there (choose /dev/shm or another folder)")


def check_output_dir(path: str) -> None:
    """Raise ConfigError naming ``run.output_dir`` when the run could not write there: it is a
    file, cannot be created, or a test file cannot be written (read-only, /proc, disk full). A folder
    it creates is made 0700: checkpoints, rollouts and token records are the run owner's alone."""
    import os
    import tempfile
    from pathlib import Path

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"run.output_dir={path!r} is a file, not a folder; choose a folder path")
    try:
        created = not p.exists()
        p.mkdir(parents=True, exist_ok=True)
        if created:  # checkpoints, rollouts and the token record are the run owner's alone
            os.chmod(p, 0o700)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-check-")
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"run.output_dir={path!r} is not writable: {exc.strerror or exc}; "
                          "choose a folder this user can write") from exc


def check_mode(cfg: RelaxConfig, device: str) -> None:
    """Refuse ``weights.transport: nccl`` in async mode (ConfigError naming it and the device) and the
    combinations ``runtime.kind: ray`` cannot run (:func:`check_ray_combination`), and
    ``runtime.autoscale.enabled`` without it (only Ray actors can be added); warn about ``weights``
    keys that ``mode: colocate`` ignores.

    Async mode's engine shares the trainer's process, which nccl cannot reach (it broadcasts
    to rollout processes on CUDA GPUs); colocate publishes through ``inproc`` whatever is set.
    """
    if cfg.runtime.kind == "ray":
        check_ray_combination(cfg)
    elif cfg.runtime.autoscale.enabled:
        raise ConfigError(f"runtime.autoscale.enabled=true with runtime.kind={cfg.runtime.kind!r}: the autoscaler "
                          "adds and drains rollout replicas, which are Ray actors; set runtime.kind=ray (or "
                          "runtime.autoscale.enabled=false)")
    if cfg.mode == "async" and cfg.weights.transport == "nccl":
        why = (f"run.device resolves to {device!r} and nccl needs CUDA GPUs" if not device.startswith("cuda") else
               "nccl reaches rollout engines in other processes, and this run's engine shares the trainer's process")
        raise ConfigError(f"weights.transport='nccl' with mode=async: {why}; use weights.transport=tcp or inproc")
    if cfg.mode == "colocate":
        ignored = _changed_keys("weights", cfg.weights, keep=("check_finite",))
        if ignored:
            warnings.warn(f"mode=colocate ignores {', '.join(ignored)}: colocate always publishes weights through "
                          "weights.transport=inproc (the engine shares the trainer's device); these keys apply to "
                          "mode=async", stacklevel=2)


def check_ray_combination(cfg: RelaxConfig) -> None:
    """Refuse config combinations ``runtime.kind: ray`` cannot run, before any model loads.

    Raises:
        ConfigError: ``mode`` is not async (colocate shares one process), ``weights.transport`` is
            not tcp (replicas are other processes, maybe other hosts), or
            ``runtime.trainer_hang_timeout_s`` is not above ``weights.publish_timeout_s``.
    """
    if cfg.mode != "async":
        raise ConfigError(f"runtime.kind='ray' with mode={cfg.mode!r}: rollout replicas are other processes, "
                          "so rollout and training cannot share one; set mode=async (max_staleness=0 stays on-policy)")
    if cfg.weights.transport != "tcp":
        raise ConfigError(f"runtime.kind='ray' with weights.transport={cfg.weights.transport!r}: replicas pull "
                          "weights from the trainer actor over the network; set weights.transport=tcp")
    hang = cfg.runtime.trainer_hang_timeout_s
    if hang is not None and hang <= cfg.weights.publish_timeout_s:
        raise ConfigError(f"runtime.trainer_hang_timeout_s={hang:g} is not above weights.publish_timeout_s="
                          f"{cfg.weights.publish_timeout_s:g}: an update's publish may wait that long for slow "
                          "replicas, which is not a hang; raise runtime.trainer_hang_timeout_s (or lower "
                          "weights.publish_timeout_s)")


def _changed_keys(section: str, value: Any, keep: tuple[str, ...] = ()) -> list[str]:
    """``section.key=value`` for each key of ``value`` (other than ``keep``) that differs from its
    section's default."""
    default = type(value)().model_dump()
    return [f"{section}.{k}={v!r}" for k, v in value.model_dump().items() if v != default[k] and k not in keep]


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


@functools.cache
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
