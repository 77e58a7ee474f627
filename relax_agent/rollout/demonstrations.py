"""Demonstrations for a supervised warm-up: the env's reference replies, rendered token-in/token-out.

Each sample is the task's prompt exactly as an episode renders it, followed by the reference
reply written the way the policy's tool parser reads it back and the turn's stop token, with
``loss_mask`` on the reply: the same fields a rollout puts on the data bus, so the trainer
collates them the same way. A multi-turn demonstration (the env returns the messages after the
prompt: assistant replies and the observations between them) is laid out as an episode is: each
reply and its stop token under the loss mask, each observation appended as the chat template's
delta (:meth:`~relax_agent.rollout.chat.ChatRenderer.observation_delta`) outside it. With a multimodal policy's renderer
(:class:`~relax_agent.multimodal.render.MediaRenderer`) the prompt's media placeholders are
expanded exactly as in an episode and each row carries its ``media``
(:class:`~relax_agent.records.MediaInputs`), so the warm-up's forward sees the images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from relax_agent import records as R
from relax_agent.errors import ConfigError
from relax_agent.rollout.engines.base import default_stop_ids
from relax_agent.rollout.env_driver import MediaRendering
from relax_agent.rollout.parsers import format_message


@runtime_checkable
class HasDemonstrations(Protocol):
    """An env (its ``unwrapped``) that can show a correct episode for a task: what the SFT warm-up
    (``trainer.sft_warmup_steps``) trains on."""

    def demonstration(self, task: dict[str, Any]) -> Any:
        """The assistant reply (or list of replies, one per turn) that solves ``task``, as chat
        message dicts; None when the task has none."""
        ...


def demonstration_fields(make_env: Callable[[], Any], renderer: Any, parser: Any,
                         tasks: Sequence[dict[str, Any]], seed: int) -> dict[str, list[Any]]:
    """Fields ``token_ids`` [T], ``loss_mask`` [T] int8, ``rollout_logprobs`` [T] (zeros), ``media``
    (the prompt's :class:`~relax_agent.records.MediaInputs`, None without media) and ``task_id``
    of one demonstration per task that has one (``env.unwrapped.demonstration(task)``: one
    assistant message, or the list of messages after the prompt for a multi-turn one).

    Args:
        renderer: the episode driver's renderer: a :class:`~relax_agent.rollout.chat.ChatRenderer`, or a media renderer
            whose ``render_prompt`` returns a segment with ``token_ids`` and ``media``
            (both have ``tokenizer`` and ``end_of_turn_ids``).

    Raises:
        ConfigError: the env has no ``demonstration`` method, or none of ``tasks`` has one.
    """
    env = make_env()
    try:
        inner = env.unwrapped
        if not isinstance(inner, HasDemonstrations):
            raise ConfigError(f"trainer.sft_warmup_steps > 0 needs demonstrations, and {type(inner).__name__} has no "
                              "demonstration(task) method; set trainer.sft_warmup_steps=0")
        stop = _stop_token(renderer)
        out: dict[str, list[Any]] = {R.TOKEN_IDS: [], R.LOSS_MASK: [], R.ROLLOUT_LOGPROBS: [], R.MEDIA: [],
                                     "task_id": []}
        for task in tasks:
            reply = inner.demonstration(task)
            if reply is None:
                continue
            obs, info = env.reset(seed=seed, options={"task": task})
            rendered = renderer.render_prompt(obs, (info or {}).get("tools", ()))
            tokens, mask = _episode_tokens(renderer, parser, list(rendered.token_ids),
                                           reply if isinstance(reply, list) else [reply], stop)
            out[R.TOKEN_IDS].append(np.asarray(tokens, dtype=np.int64))
            out[R.LOSS_MASK].append(np.asarray(mask, dtype=np.int8))
            out[R.ROLLOUT_LOGPROBS].append(np.zeros(len(tokens), dtype=np.float32))
            out[R.MEDIA].append(rendered.media if isinstance(renderer, MediaRendering) else None)
            out["task_id"].append(str(task["id"]))
    finally:
        env.close()
    if not out["task_id"]:
        raise ConfigError(f"none of the {len(tasks)} train tasks has a demonstration; set trainer.sft_warmup_steps=0")
    return out


def _episode_tokens(renderer: Any, parser: Any, prompt: list[int], messages: list[dict[str, Any]],
                    stop: int) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a demonstrated episode: ``prompt``, then each assistant message as
    the parser writes it plus ``stop`` (mask 1), each run of other messages as an observation delta
    (mask 0).

    Raises:
        ConfigError: the messages do not start with an assistant reply or do not end with one.
    """
    roles = [m.get("role") for m in messages]
    if not roles or roles[0] != "assistant" or roles[-1] != "assistant":
        raise ConfigError(f"a demonstration must start and end with an assistant message; got roles {roles}")
    tokens, mask = list(prompt), [0] * len(prompt)
    pending: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            delta = renderer.observation_delta(pending, closed=True, calls=calls)
            tokens += delta
            mask += [0] * len(delta)
            pending = []
        calls = list(message.get("tool_calls") or ())
        target = renderer.tokenizer(format_message(parser, message), add_special_tokens=False)["input_ids"] + [stop]
        tokens += target
        mask += [1] * len(target)
    return tokens, mask


def _stop_token(renderer: Any) -> int:
    """The token that ends a sampled assistant turn (the engine's stop id the template closes turns with)."""
    stops = set(default_stop_ids(renderer.tokenizer))
    closing = [t for t in renderer.end_of_turn_ids if t in stops]
    if closing:
        return closing[0]
    if not stops:
        raise ConfigError("the tokenizer has no EOS or <|im_end|> token to end a demonstrated turn")
    return min(stops)
