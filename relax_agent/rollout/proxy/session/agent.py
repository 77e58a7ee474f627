"""The endpoint's state for one episode (:class:`AgentSession`): requests accepted, replayed,
abandoned; each answer's choices recorded into segments and the reply tree (see the package doc)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser, decodes_special_tokens, parse_reply
from relax_agent.rollout.proxy.openai_api import Answer, ChatRequest, Choice, RequestError, now_s
from relax_agent.rollout.proxy.session.calls import content_key, normalise
from relax_agent.rollout.proxy.session.planning import Plan, Planning
from relax_agent.rollout.proxy.session.records import Records, SessionStats
from relax_agent.rollout.proxy.session.sampling import OnText, Sampled, Sampling, streams_tokens
from relax_agent.rollout.proxy.session.text import token_bytes
from relax_agent.rollout.proxy.session.tree import Reply, Segment
from relax_agent.rollout.recorder import TrajectoryRecorder


def mixed_seed(request_seed: int, episode_seed: int, request: int) -> int:
    """A request's own ``seed`` mixed with its episode's seed and the request's number: an integer in
    [0, 2**31 - 65) (room for ``n`` choices), equal for equal inputs. SHA-256 of the three numbers."""
    digest = hashlib.sha256(f"{request_seed}:{episode_seed}:{request}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**31 - 65)


@dataclass
class AgentSession(Planning, Sampling, Records):
    """The endpoint's state for one episode.

    Args:
        spec: the episode (ids and ``max_total_tokens``; ``seed`` seeds requests without one).
        key: the episode's API key.
        engine / renderer / parser: the policy, its chat template, its tool-call parser.
        params: the run's sampling parameters (temperature, top_p, max_new_tokens, stop ids).
        honor_request_sampling: requests may set their own temperature / top_p.
        model_name: the model id answers carry.
        task_messages: the task's opening messages (the trained chain starts from a conversation
            holding them); empty: any conversation.
        max_tokens_over_budget: a request's ``max_tokens`` above what the episode has left:
            "cap" lowers it (the response carries ``x-relax-max-tokens``), "refuse" answers 400.
        max_sampled_tokens: most tokens sampled for the episode over all its requests (a request's
            ``max_new_tokens x n`` is reserved while it runs); past it requests get 400
            (``episode_token_budget_exceeded``); None: no cap.
    """

    spec: EpisodeSpec
    key: str
    engine: InferenceEngine
    renderer: ChatRenderer
    parser: ToolCallParser
    params: SamplingParams
    honor_request_sampling: bool = False
    model_name: str = "policy"
    task_messages: Sequence[dict[str, Any]] = ()
    max_tokens_over_budget: str = "cap"
    max_sampled_tokens: int | None = None
    stats: SessionStats = field(default_factory=SessionStats)
    segments: list[Segment] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    closed: bool = False
    _answers: dict[str, asyncio.Future] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _started: int = 0
    _calls: int = 0
    _by_answer: dict[str, list[Reply]] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)
    _reserved: int = 0

    def __post_init__(self) -> None:
        self._streams = streams_tokens(self.engine)
        tok = self.renderer.tokenizer
        eos = tok.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self._close_ids = frozenset(self.renderer.end_of_turn_ids[:1]) | frozenset(eos_ids) | self.renderer.stop_ids
        self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)
        keep = decodes_special_tokens(self.parser)
        self._parse_decode = (lambda ids: tok.decode(list(ids), skip_special_tokens=False)) if keep else self._decode
        self._task = [normalise(m) for m in self.task_messages if m.get("role") not in ("system", "developer")]

    # -- requests -------------------------------------------------------------------------
    async def submit(self, req: ChatRequest, body_key: str, replay: bool, on_text: OnText | None = None,
                     notes: dict[str, str] | None = None, info: dict[str, int] | None = None) -> asyncio.Future:
        """Start answering ``req`` (on the running loop); the future gives its :class:`Answer`. The
        request's messages are matched and tokenized in a worker thread, never on the event loop
        other episodes are served from (a large history cannot stall them).

        Args:
            body_key: hash of the request body (retries are recognised by it).
            replay: the request is a retry (SDK retry header or a known idempotency key): answer it
                from the record when an identical body was answered or is being answered.
            on_text: streaming listener, called as the text of each choice grows.
            notes: filled with response headers to send (``x-relax-max-tokens`` when capped).
            info: filled with ``prompt_tokens`` (the prompt's length) once planned (not for a replay).

        Raises:
            RequestError: the session has ended (401), or the request cannot be honoured (400).
        """
        if self.closed:
            raise RequestError("this episode's session has ended (the agent's API key is no longer valid)",
                               status=401, code="invalid_api_key")
        self.stats.requests += 1
        if replay and body_key in self._answers:
            self.stats.replayed += 1
            return asyncio.ensure_future(asyncio.shield(self._answers[body_key]))
        plan = await asyncio.to_thread(self._plan, req)
        if info is not None:
            info["prompt_tokens"] = len(plan.prompt_ids)
        if self.closed:
            raise RequestError("this episode's session has ended (the agent's API key is no longer valid)",
                               status=401, code="invalid_api_key")
        params = self._sampling(req, plan, notes)
        turn = self._started
        self._started += 1
        reserved = params.max_new_tokens * req.n
        self._reserved += reserved
        task = asyncio.ensure_future(self._answer(req, plan, params, turn, on_text))
        task.add_done_callback(lambda t: self._settle(t, reserved))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._answers[body_key] = task
        task.add_done_callback(lambda t: self._forget_failed(body_key, t))
        return asyncio.ensure_future(asyncio.shield(task))

    def _settle(self, task: asyncio.Future, reserved: int) -> None:
        """Replace a finished request's reservation of sampled tokens by what it sampled (nothing when
        it failed before returning: a refused or aborted request costs the episode nothing)."""
        self._reserved -= reserved
        if not task.cancelled() and task.exception() is None:
            self._reserved += task.result().completion_tokens

    def _forget_failed(self, body_key: str, task: asyncio.Future) -> None:
        if (task.cancelled() or task.exception() is not None) and self._answers.get(body_key) is task:
            del self._answers[body_key]

    def abandon(self, body_key: str) -> bool:
        """Abort the generation answering ``body_key`` (its stream was closed by the agent): nothing of
        it is recorded. True when one was still running (counted in ``agent/aborted``)."""
        task = self._answers.get(body_key)
        if task is None or task.done():
            return False
        task.cancel()
        self.stats.aborted += 1
        return True

    async def aclose(self) -> None:
        """End the session: refuse new requests and abort generations still running (awaits them)."""
        self.closed = True
        running = [t for t in self._tasks if not t.done()]
        for t in running:
            t.cancel()
        self.stats.aborted += len(running)
        await asyncio.gather(*running, return_exceptions=True)

    # -- answering ------------------------------------------------------------------------
    async def _answer(self, req: ChatRequest, plan: Plan, params: SamplingParams, turn: int,
                      on_text: OnText | None) -> Answer:
        forced_text, forced = self._forced_text(req), self._forced_ids(req)
        markers = self._markers(req)
        seed = self.spec.seed * 1009 + turn if req.seed is None else mixed_seed(req.seed, self.spec.seed, turn)
        prompt = list(plan.prompt_ids) + list(forced)
        sampled = await asyncio.gather(*(
            self._sample(i, prompt, dataclasses.replace(params, seed=seed + i), markers, forced_text, on_text)
            for i in range(req.n)))
        answer_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [self._record(req, plan, s, forced, i, turn, answer_id, prompt) for i, s in enumerate(sampled)]
        self._check_tool_choice(req, choices, answer_id)
        return Answer(answer_id, req.model or self.model_name, tuple(choices),
                      len(plan.prompt_ids), sum(len(s.gen.token_ids) for s in sampled), req.logprobs, now_s())

    def _record(self, req: ChatRequest, plan: Plan, s: Sampled, forced: tuple[int, ...], index: int,
                request: int, answer_id: str, prompt: list[int]) -> Choice:
        """Add choice ``index`` to its segment and to the reply tree; return it as the agent sees it."""
        content, calls, internal, failed = self._reply(req, s.text, s.parsed_text or s.text)
        self.stats.tool_parse_failures += failed
        seg = self._segment_for(plan, index)
        if plan.base is None:
            seg.rec.add_prompt(plan.context_ids, plan.rendered)
        else:
            seg.rec.add_context(plan.context_ids)
            seg.rec.add_messages(plan.new_messages)
        closed = bool(s.gen.token_ids) and s.gen.token_ids[-1] in self._close_ids
        seg.rec.add_context(forced)
        seg.rec.add_turn(s.gen, opening=len(forced), closed=closed)
        seg.rec.add_messages([internal])
        seg.closed = closed
        tok = self.renderer.tokenizer
        tokens = tuple(tok.decode([t]) for t in s.gen.token_ids) if req.logprobs else ()
        choice = Choice(content, calls, "tool_calls" if calls else ("length" if s.gen.finish_reason == "length" else "stop"),
                        tokens, s.gen.logprobs if req.logprobs else (),
                        token_bytes(tok, s.gen.token_ids) if req.logprobs else (), s.stop_string)
        seg.convo = list(plan.convo) + [normalise(choice.message())]
        seg.version += 1
        parent = plan.base.replies[plan.base.marks.index(plan.base_state)] if plan.base is not None else plan.linked
        on_task = parent.on_task if parent is not None else self._holds_task(plan.convo)
        reply = Reply(len(self.replies), request, index, seg, seg.state(), parent, choice.content or "",
                      len(s.gen.token_ids), content_key(choice.message()), on_task)
        if parent is not None:
            parent.children.append(reply)
        self.replies.append(reply)
        self._by_answer.setdefault(answer_id, []).append(reply)
        seg.marks.append(reply.state)
        seg.replies.append(reply)
        key = hashlib.sha256(json.dumps([prompt, list(s.gen.token_ids)]).encode()).hexdigest()
        self.stats.duplicate_replies += key in self._seen
        self._seen.add(key)
        return choice

    def _check_tool_choice(self, req: ChatRequest, choices: Sequence[Choice], answer_id: str) -> None:
        """Refuse an answer that does not honour ``tool_choice`` "required" / a named function: every
        choice must call an allowed tool (the named one). The replies stay recorded, undelivered.

        Raises:
            RequestError: HTTP 500 (as OpenAI's "the model produced invalid content"), code
                ``invalid_tool_call``; the request is not replayed, so a retry samples anew.
        """
        mode = req.tool_choice.mode
        if mode not in ("required", "function"):
            return
        if mode == "function":
            assert req.tool_choice.name is not None  # _tool_choice names the function of this mode
            allowed = {req.tool_choice.name}
        else:
            allowed = {t["function"]["name"] for t in req.tools}
        for i, c in enumerate(choices):
            names = [call["function"]["name"] for call in c.tool_calls]
            if not names or not set(names) <= allowed:
                self.delivered(answer_id, False)
                got = f"calls of {names}" if names else f"no parseable call (text {(c.content or '')[:200]!r})"
                raise RequestError(f"tool_choice={mode if mode == 'required' else req.tool_choice.name!r} needs a call "
                                   f"of {sorted(allowed)}, but choice {i} of the policy's reply has {got}; retry the "
                                   "request (a retry samples anew) or use tool_choice 'auto'", "tool_choice",
                                   status=500, code="invalid_tool_call")

    def _holds_task(self, convo: Sequence[str]) -> bool:
        """The conversation holds every non-system opening message of the task, in order."""
        it = iter(convo)
        return all(any(m == t for m in it) for t in self._task)

    def delivered(self, answer_id: str, delivered: bool) -> None:
        """Whether the response of ``answer_id`` reached the agent (False: it had hung up first).
        A reply once delivered (e.g. by a retry's replay) stays delivered."""
        for reply in self._by_answer.get(answer_id, ()):
            if reply.delivered is not True:
                reply.delivered = delivered

    def _segment_for(self, plan: Plan, index: int) -> Segment:
        """Choice 0 extends the planned segment in place when nobody extended it meanwhile; otherwise
        (and for siblings) a copy of the planned prefix becomes a new segment. A fresh render is a new
        segment: a "continuation" when its history holds an earlier reply, else a "branch"."""
        if plan.base is None:
            fresh = "continuation" if plan.linked is not None else "branch"
            kind = "first" if not self.segments else ("sibling" if index else fresh)
            seg = Segment(TrajectoryRecorder(self.spec), [], plan.tools_key, kind=kind)
        elif index == 0 and plan.base.version == plan.base_version and plan.base.state() == plan.base_state:
            return plan.base
        else:
            seg = plan.base.fork(plan.base_state, "sibling" if index else "branch")
        if seg.kind == "branch":
            self.stats.branches += 1
        elif seg.kind == "continuation":
            self.stats.continuations += 1
        elif seg.kind == "sibling":
            self.stats.siblings += 1
        self.segments.append(seg)
        return seg

    def _reply(self, req: ChatRequest, text: str,
               parsed_text: str) -> tuple[str | None, tuple[dict[str, Any], ...], dict[str, Any], int]:
        """(content, OpenAI tool calls, the assistant message for the record, 1 if the calls did not parse).

        ``text``: the reply with special tokens skipped (content as shown); ``parsed_text``: the reply
        as the run's tool-call parser reads it (special tokens kept where its call markers are special
        tokens, as the env driver decodes them). The record's tokens are the sampled ids either way.
        """
        if not req.tools or req.tool_choice.mode == "none":
            return text, (), {"role": "assistant", "content": text, "tool_calls": []}, 0
        parsed = parse_reply(self.parser, parsed_text, req.tools)
        if parsed.errors:
            internal: dict[str, Any] = {"role": "assistant", "content": parsed_text.strip(), "tool_calls": [],
                                        "parse_errors": list(parsed.errors)}
            return text.strip(), (), internal, 1
        calls: list[dict[str, Any]] = []
        for c in parsed.tool_calls:
            self._calls += 1
            calls.append({"id": f"call_{self._calls}", "type": "function",
                          "function": {"name": c["function"]["name"],
                                       "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}})
        internal = {"role": "assistant", "content": parsed.content,
                    "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in calls]}
        if parsed.reasoning:
            internal["reasoning_content"] = parsed.reasoning
        content = (parsed.content or None) if calls else parsed.content
        return content, tuple(calls), internal, 0
