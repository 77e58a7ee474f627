"""Demonstrations for a supervised warm-up: the env's reference replies, rendered token-in/token-out.

Each sample is the task's prompt exactly as an episode renders it, followed by the reference
reply written the way the policy's tool parser reads it back and the turn's stop token, with
``loss_mask`` on the reply: the same fields a rollout puts on the data bus, so the trainer
collates them the same way. With a multimodal policy's renderer
(:class:`~relax_agent.multimodal.render.MediaRenderer`) the prompt's media placeholders are
expanded exactly as in an episode and each row carries its ``media``
(:class:`~relax_agent.records.MediaInputs`), so the warm-up's forward sees the images.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from relax_agent import records as R
from relax_agent.errors import ConfigError
from relax_agent.rollout.engines.base import default_stop_ids
from relax_agent.rollout.parsers import format_message


def demonstration_fields(make_env: Callable[[], Any], renderer: Any, parser: Any,
                         tasks: Sequence[dict[str, Any]], seed: int) -> dict[str, list[Any]]:
    """Fields ``token_ids`` [T], ``loss_mask`` [T] int8, ``rollout_logprobs`` [T] (zeros), ``media``
    (the prompt's :class:`~relax_agent.records.MediaInputs`, None without media) and ``task_id``
    of one demonstration per task that has one (``env.unwrapped.demonstration(task)``).

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
        if not callable(getattr(inner, "demonstration", None)):
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
            prompt = list(rendered.token_ids)
            text = format_message(parser, reply)
            target = renderer.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
            out[R.TOKEN_IDS].append(np.asarray(prompt + target, dtype=np.int64))
            out[R.LOSS_MASK].append(np.asarray([0] * len(prompt) + [1] * len(target), dtype=np.int8))
            out[R.ROLLOUT_LOGPROBS].append(np.zeros(len(prompt) + len(target), dtype=np.float32))
            out[R.MEDIA].append(getattr(rendered, "media", None))
            out["task_id"].append(str(task["id"]))
    finally:
        env.close()
    if not out["task_id"]:
        raise ConfigError(f"none of the {len(tasks)} train tasks has a demonstration; set trainer.sft_warmup_steps=0")
    return out


def _stop_token(renderer: Any) -> int:
    """The token that ends a sampled assistant turn (the engine's stop id the template closes turns with)."""
    stops = set(default_stop_ids(renderer.tokenizer))
    closing = [t for t in renderer.end_of_turn_ids if t in stops]
    if closing:
        return closing[0]
    if not stops:
        raise ConfigError("the tokenizer has no EOS or <|im_end|> token to end a demonstrated turn")
    return min(stops)
