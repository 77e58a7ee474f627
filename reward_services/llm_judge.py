"""LLM-as-judge reward: any OpenAI-compatible chat endpoint grades the response by a rubric.

The judge sees the rubric (system prompt), the conversation, the response and, when the
item has one, the reference answer; it must end its reply with ``Score: N`` (0..max_score).
The reward is ``N / max_score`` in [0, 1]. A reply without a parseable score, or an
endpoint failure after the OpenAI client's own retries, makes the item ``status: error``
(masked), never a 0.

Use it as a factory target (``source: local``)::

    function: relax_agent.reward_services.llm_judge:LLMJudge
    kwargs: {base_url: "http://127.0.0.1:8000/v1", model: "qwen3-8b", api_key_env: JUDGE_KEY}

or serve it: ``relax-agent serve-reward relax_agent.reward_services.llm_judge:LLMJudge
--kwargs '{"base_url": ..., "model": ...}'``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from relax_agent.errors import ConfigError, RewardServiceError
from relax_agent.reward_services.client import LoopBound
from relax_agent.reward_services.protocol import RewardItem

DEFAULT_RUBRIC = """You are a strict grader of an AI assistant's final response.
Judge whether the response correctly and helpfully completes the user's request; when a
reference answer is given, a response that contradicts it is wrong.
Explain briefly, then end with a line of the form "Score: N", where N is an integer from 0
(useless or wrong) to {max_score} (fully correct and helpful)."""

_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)


def parse_score(text: str, max_score: float) -> float:
    """The last ``Score: N`` (or ``Score: N/M``, rescaled to ``max_score``) in ``text``.

    Raises:
        ValueError: no score, or a score outside [0, max_score].
    """
    matches = _SCORE.findall(text)
    if not matches:
        raise ValueError(f"judge reply has no 'Score: N' line: {text[-200:]!r}")
    value, scale = matches[-1]
    score = float(value) * (max_score / float(scale) if scale else 1.0)
    if not 0.0 <= score <= max_score:
        raise ValueError(f"judge score {score} is outside [0, {max_score}]")
    return score


class LLMJudge:
    """A per-item async reward that asks an OpenAI-compatible endpoint for a score.

    Args:
        base_url: the endpoint's OpenAI base URL, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: model name sent with each request.
        rubric: system prompt; ``{max_score}`` in it is replaced. Must ask for "Score: N".
        api_key_env: environment variable with the API key; None sends a placeholder
            key (local servers ignore it).
        max_score: top of the judge's scale.
        temperature: sampling temperature of the judge.
        max_tokens: length cap of the judge's reply.
        timeout_s: timeout of one judge request, seconds.
        max_retries: the OpenAI client's retries on connection errors, 408/409/429/5xx.
        completion_kwargs: extra arguments passed as is to ``chat.completions.create``.

    Raises:
        ConfigError: a bad ``max_score`` or an unset ``api_key_env`` variable.
    """

    def __init__(self, base_url: str, model: str, rubric: str = DEFAULT_RUBRIC, api_key_env: str | None = None,
                 max_score: float = 10.0, temperature: float = 0.0, max_tokens: int = 512, timeout_s: float = 60.0,
                 max_retries: int = 2, completion_kwargs: dict[str, Any] | None = None):
        if not max_score > 0:
            raise ConfigError(f"max_score must be > 0, got {max_score!r}")
        self._api_key = "not-needed"
        if api_key_env is not None:
            self._api_key = os.environ.get(api_key_env, "")
            if not self._api_key:
                raise ConfigError(f"LLMJudge api_key_env={api_key_env!r}: environment variable is unset or empty")
        self.base_url, self.model, self.max_score = base_url, model, float(max_score)
        self.rubric = rubric.replace("{max_score}", f"{max_score:g}")
        self._request = {"temperature": temperature, "max_tokens": max_tokens, **(completion_kwargs or {})}
        self._timeout_s, self._max_retries = timeout_s, max_retries
        self._client: LoopBound[Any] = LoopBound(self._open_client, lambda client: client.close())

    def _open_client(self) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self._api_key, timeout=self._timeout_s,
                                  max_retries=self._max_retries)

    def prompt(self, item: RewardItem) -> list[dict[str, str]]:
        """The chat messages sent to the judge for ``item``."""
        parts = ["## Conversation", _render(item.messages) or "(none)", "## Response to grade", _response(item)]
        if item.ground_truth not in (None, ""):
            gt = item.ground_truth if isinstance(item.ground_truth, str) else json.dumps(item.ground_truth, default=str)
            parts += ["## Reference answer", gt]
        return [{"role": "system", "content": self.rubric}, {"role": "user", "content": "\n\n".join(parts)}]

    async def __call__(self, item: RewardItem) -> dict[str, Any]:
        """``{"reward": score / max_score, "metrics": {"judge_score"}, "extra": {"judgement"}}``.

        Raises:
            RewardServiceError: the endpoint failed after its retries.
            ValueError: the reply holds no valid score.
        """
        import openai

        client = await self._client.get()
        try:
            reply = await client.chat.completions.create(model=self.model, messages=self.prompt(item), **self._request)
        except openai.OpenAIError as exc:
            raise RewardServiceError(f"judge endpoint {self.base_url} failed: {type(exc).__name__}: {exc}") from exc
        text = reply.choices[0].message.content or ""
        score = parse_score(text, self.max_score)
        return {"reward": score / self.max_score, "metrics": {"judge_score": score}, "extra": {"judgement": text}}

    async def aclose(self) -> None:
        """Close the HTTP client of the OpenAI SDK."""
        await self._client.aclose()


def _render(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "[media]") for p in content if isinstance(p, dict))
        line = f"{m.get('role', '?')}: {content or ''}"
        if m.get("tool_calls"):
            line += f"\n  tool_calls: {json.dumps(m['tool_calls'], default=str)}"
        lines.append(line)
    return "\n".join(lines)


def _response(item: RewardItem) -> str:
    text = item.response_text()
    calls = item.tool_calls()
    return f"{text}\ntool_calls: {json.dumps(calls, default=str)}" if calls else text
