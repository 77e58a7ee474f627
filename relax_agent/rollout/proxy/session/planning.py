"""Where a request's reply goes (the segment its messages extend, or a fresh render) and what it may
sample: the run's sampling parameters checked against the request, the episode's token budgets,
``tool_choice``'s forced opening, the markers that end a reply."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.rollout.chat import ChatRenderer, text_of
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.parsers import HermesParser, ToolCallParser
from relax_agent.rollout.proxy.openai_api import ChatRequest, RequestError
from relax_agent.rollout.proxy.session.calls import call_opening, call_text, content_key, continues, normalise
from relax_agent.rollout.proxy.session.records import SessionStats
from relax_agent.rollout.proxy.session.tree import Reply, Segment


def _tools_key(tools: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Plan:
    """Where a request's reply goes: the segment it extends (None: a fresh render) and the tokens; for
    a fresh render, the earlier reply its history holds re-templated (``linked``, None: none)."""

    base: Segment | None
    base_version: int
    base_state: tuple[int, int, int, bool]
    prompt_ids: tuple[int, ...]
    context_ids: tuple[int, ...]
    """Tokens to append before sampling: the new messages' delta, or the whole rendered prompt."""
    new_messages: tuple[dict[str, Any], ...]
    rendered: tuple[dict[str, Any], ...]
    convo: tuple[str, ...]
    tools_key: str
    linked: Reply | None = None


class Planning:
    """:class:`~relax_agent.rollout.proxy.session.AgentSession`'s planning of a request."""

    spec: EpisodeSpec
    renderer: ChatRenderer
    parser: ToolCallParser
    params: SamplingParams
    honor_request_sampling: bool
    max_tokens_over_budget: str
    max_sampled_tokens: int | None
    stats: SessionStats
    segments: list[Segment]
    replies: list[Reply]
    _reserved: int

    def _plan(self, req: ChatRequest) -> Plan:
        convo = tuple(normalise(m) for m in req.messages)
        tools_key = _tools_key(req.tools)
        found = self._extends(convo, tools_key)
        if found is not None:
            base, state = found
            num_tokens, num_convo, _, closed = state
            new = req.messages[num_convo:]
            try:
                last = req.messages[num_convo - 1] if num_convo else {}
                calls = (last.get("tool_calls") or ()) if isinstance(last, dict) else ()
                delta = self.renderer.observation_delta(list(new), closed=closed, calls=calls)
            except Exception as exc:  # the template refuses these messages after an assistant turn
                raise RequestError(f"messages[{num_convo}:] cannot be rendered after the assistant turn: "
                                   f"{type(exc).__name__}: {exc}", "messages") from exc
            prompt = tuple(base.rec.token_ids[:num_tokens]) + tuple(delta)
            return Plan(base, base.version, state, prompt, tuple(delta), tuple(new), (), convo, tools_key)
        try:
            rendered = self.renderer.render_prompt(self._as_template_messages(req.messages), req.tools)
        except Exception as exc:
            raise RequestError(f"messages cannot be rendered by the policy's chat template: "
                               f"{type(exc).__name__}: {exc}", "messages") from exc
        return Plan(None, 0, (0, 0, 0, True), rendered.token_ids, rendered.token_ids, (), rendered.messages, convo,
                    tools_key, self._continued(req.messages))

    def _continued(self, messages: Sequence[dict[str, Any]]) -> Reply | None:
        """The earlier reply a request that extends no segment builds on: the one its last assistant
        message holding any reply holds (:func:`~.calls.continues`; the same content before content
        inside a longer text, then a delivered reply, then the latest); None: no assistant message
        holds one (a new conversation, or a history rewritten past recognition)."""
        replies = list(self.replies)  # planned in a worker thread while replies are recorded
        for message in reversed(messages):
            if message.get("role") != "assistant":
                continue
            sent = content_key(message)
            ranked = [(how, r.delivered is not False, r.order, r) for r in replies if (how := continues(sent, r.key))]
            if ranked:
                return max(ranked, key=lambda x: x[:3])[3]
        return None

    def _extends(self, convo: tuple[str, ...], tools_key: str) -> tuple[Segment, tuple[int, int, int, bool]] | None:
        """(segment, state after one of its turns) whose conversation ``convo`` extends by
        non-assistant messages only, the longest such (the most recent on a tie); or None."""
        best = None
        for seg in self.segments:
            if seg.tools_key != tools_key:
                continue
            for state in seg.marks:
                n = state[1]
                if n >= len(convo) or best is not None and n < best[1][1] or tuple(seg.convo[:n]) != convo[:n]:
                    continue
                if not any(json.loads(m)["role"] == "assistant" for m in convo[n:]):
                    best = (seg, state)
        return best

    def _as_template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages for a fresh render: assistant tool calls written in the parser's own format when
        the template does not render ``tool_calls`` (it reads no ``tools``), tool results as user
        messages for templates that refuse a tool role."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls") and not self.renderer.use_template_tools:
                calls = "".join(call_text(self.parser, c) for c in m["tool_calls"])
                text = text_of(m.get("content"))
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
            elif m["role"] == "tool" and self.renderer.tool_role == "user":
                out.append({"role": "user", "content": f"<tool_response>\n{text_of(m.get('content'))}\n</tool_response>"})
            else:
                out.append({k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")})
        return out

    def prompt_tokens(self, req: ChatRequest) -> int:
        """The length of the prompt ``req`` would be sampled from now (as its answer's usage reports
        it), planned as :meth:`AgentSession.submit` plans it; nothing is sampled or recorded.

        Raises:
            RequestError: the messages cannot be rendered by the chat template.
        """
        return len(self._plan(req).prompt_ids)

    def _sampling(self, req: ChatRequest, plan: Plan, notes: dict[str, str] | None = None) -> SamplingParams:
        base = self.params
        for key, asked, run in (("temperature", req.temperature, base.temperature), ("top_p", req.top_p, base.top_p)):
            if asked is not None and asked != run and not self.honor_request_sampling:
                raise RequestError(f"{key}={asked} differs from rollout.{key}={run}, at which the trainer scores the "
                                   f"policy's log-probs; omit {key} or set rollout.agent.honor_request_sampling=true",
                                   key)
        used = len(plan.prompt_ids) + len(self._forced_ids(req))
        room = self.spec.max_total_tokens - used
        if room < 1:
            raise RequestError(f"the conversation is {used} tokens, at or past this episode's budget "
                               f"rollout.max_total_tokens={self.spec.max_total_tokens}", "messages",
                               code="context_length_exceeded")
        limit = min(base.max_new_tokens, room)
        why = f"rollout.max_new_tokens={base.max_new_tokens}, {room} tokens left of " \
              f"rollout.max_total_tokens={self.spec.max_total_tokens}"
        if self.max_sampled_tokens is not None:
            left = self.max_sampled_tokens - self._reserved
            if left < req.n:
                raise RequestError(f"this episode has sampled (or is sampling) {self._reserved} tokens over its requests, "
                                   f"its budget rollout.agent.max_episode_sampled_tokens={self.max_sampled_tokens} leaves "
                                   f"{max(left, 0)} for {req.n} choice(s); end the episode",
                                   code="episode_token_budget_exceeded")
            limit = min(limit, left // req.n)
            why += f", {left} tokens left of rollout.agent.max_episode_sampled_tokens={self.max_sampled_tokens}"
        wanted = req.max_tokens if req.max_tokens is not None else base.max_new_tokens
        if req.max_tokens is not None and req.max_tokens > limit:
            if self.max_tokens_over_budget == "refuse":
                raise RequestError(f"max_tokens={req.max_tokens} is above the {limit} tokens this request may sample "
                                   f"({why}); ask for at most {limit}", "max_tokens", code="max_tokens_exceeded")
            self.stats.capped_max_tokens += 1
        if wanted > limit and notes is not None:
            notes["x-relax-max-tokens"] = str(limit)
        return dataclasses.replace(
            base, temperature=req.temperature if req.temperature is not None else base.temperature,
            top_p=req.top_p if req.top_p is not None else base.top_p,
            max_new_tokens=min(wanted, limit), seed=None)

    def _forced_text(self, req: ChatRequest) -> str:
        """Text the reply is forced to start with (context tokens after the generation prompt): the
        request's prefill, or the opening of a call ``tool_choice`` requires."""
        if req.prefill:
            return req.prefill
        mode = req.tool_choice.mode
        if mode not in ("required", "function"):
            return ""
        opening = call_opening(self.parser)
        if opening is None:
            raise RequestError(f"tool_choice={mode!r} is enforced by opening the parser's call format, which "
                               f"{type(self.parser).__name__} has none of; use tool_choice 'auto'", "tool_choice")
        if mode == "function":
            opening += json.dumps(req.tool_choice.name)[1:] + ', "arguments": '
        return opening

    def _forced_ids(self, req: ChatRequest) -> tuple[int, ...]:
        text = self._forced_text(req)
        return tuple(self.renderer.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

    def _markers(self, req: ChatRequest) -> list[tuple[str, bool]]:
        """(text, keep) that end a reply: stop strings (cut before them) and, without parallel tool calls,
        the parser's closing tag (kept)."""
        markers = [(s, False) for s in req.stop]
        if not req.parallel_tool_calls and req.tools and req.tool_choice.mode != "none":
            if not isinstance(self.parser, HermesParser):
                raise RequestError(f"parallel_tool_calls=false is enforced by stopping at the first closing "
                                   f"{HermesParser.CLOSE}; {type(self.parser).__name__} has no closing tag",
                                   "parallel_tool_calls")
            markers.append((HermesParser.CLOSE, True))
        return markers
