"""One agent episode seen from the endpoint: exact token-in/token-out across the agent's requests.

A session keeps every conversation it has produced as a *segment*: the token ids (prompt
rendered once, sampled turns exactly as the engine returned them, template deltas of the
messages the agent added) and, beside them, the messages those tokens stand for (normalised:
role, text, tool-call names and arguments). A request whose messages extend a segment's
messages (the agent sent the history back, plus new tool results or user turns) reuses that
segment's ids and tokenizes only the new messages, as the chat template's delta after the last
assistant turn. A request that extends no segment (the agent edited or summarised history, or
started a sub-conversation) is rendered afresh and starts a new segment, a *branch*; choices
``1..n-1`` of an ``n > 1`` request are *siblings* of the segment choice 0 went to (same prefix,
one turn each). Nothing of a past assistant turn is ever re-tokenized.

What trains: every sampled reply is a node of the episode's *reply tree* (:class:`Reply`), whose
parent is the earlier reply the request's messages contain (matched by prefix, as above; a
fresh render has none). A reply the agent sent back has children: it was *kept*. The trained
chain (:meth:`AgentSession.final_reply`) is the path that the agent built on: from the root
conversation holding the task's messages (of those, the one the agent continued furthest, then
a delivered one, then the first), down through the child the agent continued furthest, to a
reply it never sent back: the episode's final answer. Among children continued equally far, a reply whose HTTP
response the agent had already hung up on (an abandoned request) loses, then the later
request wins (a retry supersedes), then the lower choice index. When the agent names its
``answer`` (output file), the chain ends at the latest delivered reply whose content is that
answer. Replies off the chain (abandoned requests, unchosen ``n > 1`` siblings, side calls such
as a title after the answer, rewritten histories) are recorded side branches: not trained, not
scored, counted in ``agent/dropped_replies`` and ``agent/dropped_tokens``.

Seeds: a request without ``seed`` samples with ``spec.seed * 1009 + k`` (``k``: the request's
number in the episode, choice ``i`` adds ``i``); a request's own ``seed`` is mixed with the
episode's seed and ``k`` (:func:`mixed_seed`), so a framework's fixed seed neither collapses a
GRPO group (every episode has its own seed) nor repeats a sample within an episode. Replies
identical to an earlier one of the episode from the same prompt are counted in
``agent/duplicate_replies``.

Retries: a request whose ``x-stainless-retry-count`` header is above 0 (the OpenAI SDK's retry)
or whose ``Idempotency-Key`` was seen, with a body identical to an earlier one, gets the
recorded answer (waiting for it if it is still being sampled) instead of a new sample.

``tool_choice``: "required" and a named function are enforced by a forced opening of the
parser's call format (``<tool_call>\\n{"name": "`` for hermes, plus the name for a named
function) appended to the prompt as context tokens (loss mask 0) before sampling; a reply that
still has no well-formed call of an allowed tool is not returned (HTTP 500, code
``invalid_tool_call``; it stays recorded as an undelivered side branch); "none"
returns the text as content, never parsed. Replies are parsed by the run's tool-call parser
(``rollout.tool_parser``, ``auto`` resolved for the policy) from the text decoded as that parser
needs it: special tokens kept for the families whose call markers are special tokens (Llama 3's
``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``, gpt-oss channels, DeepSeek, GLM, Kimi, Gemma), as
the env driver does; the content and tool calls returned are the parser's, the recorded turn is the
sampled ids. ``parallel_tool_calls: false`` stops the reply at the
first closing ``</tool_call>`` (hermes parsers). Stop strings end the reply at their first
occurrence (the engine's row is aborted as soon as one is sampled when it streams tokens); the
recorded turn ends with the token that completed the stop string.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from relax_agent.rollout.chat import ChatRenderer, text_of
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import (
    FencedJsonParser,
    HermesParser,
    JsonParser,
    ToolCallParser,
    decodes_special_tokens,
)
from relax_agent.rollout.proxy.openai_api import Answer, ChatRequest, Choice, RequestError, now_s
from relax_agent.rollout.recorder import TrajectoryRecorder

OnText = Callable[[int, str], None]
"""Streaming listener: (choice index, the reply's text so far, forced opening included)."""


@dataclass
class SessionStats:
    """Counters of one session (they become the episode's ``agent/*`` metrics).

    Attributes:
        requests: chat completions answered (replays included).
        replayed: retried requests answered from the record.
        branches: segments started by a request that extended no earlier segment (the first excluded).
        siblings: segments made by choices ``1..n-1`` of ``n > 1`` requests.
        tool_parse_failures: replies whose tool-call text did not parse (returned as plain content).
        aborted: generations cancelled when the session closed or their stream was closed.
        duplicate_replies: replies whose tokens equal an earlier reply of the episode to the same prompt.
        capped_max_tokens: requests whose ``max_tokens`` was lowered to the episode's budget.
    """

    requests: int = 0
    replayed: int = 0
    branches: int = 0
    siblings: int = 0
    tool_parse_failures: int = 0
    aborted: int = 0
    duplicate_replies: int = 0
    capped_max_tokens: int = 0


@dataclass(eq=False)
class Reply:
    """One sampled reply (a choice of a request): a node of the episode's reply tree.

    Attributes:
        order: its position among the episode's replies, in the order they were recorded.
        request: the number of the request it answers (in the order requests arrived).
        choice: its choice index in that request.
        segment / state: the segment holding it and :meth:`Segment.state` right after it (the
            chain ending at this reply is that segment cut back to ``state``).
        parent: the reply the request's messages contained last (None: a fresh render).
        content: the text the agent got as ``content`` ("" for a reply of only tool calls).
        num_tokens: its sampled tokens.
        on_task: its conversation holds the task's opening messages.
        delivered: False when the agent had hung up before the response was sent (abandoned);
            True once any response (a replay included) carrying it was delivered; None: not known.
        children: replies of requests that sent this one back.
    """

    order: int
    request: int
    choice: int
    segment: Segment
    state: tuple[int, int, int, bool]
    parent: Reply | None
    content: str
    num_tokens: int
    on_task: bool = True
    delivered: bool | None = None
    children: list[Reply] = field(default_factory=list)

    def chain(self) -> list[Reply]:
        """[k] the replies from the root down to this one."""
        out: list[Reply] = []
        node: Reply | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


def mixed_seed(request_seed: int, episode_seed: int, request: int) -> int:
    """A request's own ``seed`` mixed with its episode's seed and the request's number: an integer in
    [0, 2**31 - 65) (room for ``n`` choices), equal for equal inputs. SHA-256 of the three numbers."""
    digest = hashlib.sha256(f"{request_seed}:{episode_seed}:{request}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**31 - 65)


@dataclass
class Segment:
    """One token-in/token-out conversation of a session.

    Attributes:
        rec: its tokens, turns and messages.
        convo: [m] normalised messages the tokens stand for (requests' messages and replies).
        tools_key: the tools it was rendered with (canonical JSON).
        closed: its last turn ends with the template's closing token (else a delta starts with it).
        kind: "first", "branch" or "sibling".
        version: bumped on every extension (concurrent requests that extended an older state fork).
        marks: :meth:`state` after each of its turns (a request may continue from any of them).
        replies: the :class:`Reply` of each mark.
    """

    rec: TrajectoryRecorder
    convo: list[str]
    tools_key: str
    closed: bool = True
    kind: str = "first"
    version: int = 0
    marks: list[tuple[int, int, int, bool]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def state(self) -> tuple[int, int, int, bool]:
        """(tokens, convo messages, recorded messages, closed) now: where a fork can cut it back to."""
        return len(self.rec.token_ids), len(self.convo), len(self.rec.messages), self.closed

    def fork(self, state: tuple[int, int, int, bool], kind: str) -> Segment:
        """A copy cut back to an earlier :meth:`state`."""
        num_tokens, num_convo, num_messages, closed = state
        rec = TrajectoryRecorder(self.rec.spec)
        rec.token_ids = self.rec.token_ids[:num_tokens]
        rec.loss_mask = self.rec.loss_mask[:num_tokens]
        rec.logprobs = self.rec.logprobs[:num_tokens]
        rec.turns = [t for t in self.rec.turns if t.start < num_tokens]
        rec.messages = self.rec.messages[:num_messages]
        kept = [i for i, m in enumerate(self.marks) if m[0] <= num_tokens]
        return Segment(rec, self.convo[:num_convo], self.tools_key, closed, kind,
                       marks=[self.marks[i] for i in kept], replies=[self.replies[i] for i in kept])


def normalise(message: dict[str, Any]) -> str:
    """What must agree for a sent message to match a recorded one: role, text, tool calls
    (name and decoded arguments), canonical JSON."""
    out: dict[str, Any] = {"role": message["role"], "content": text_of(message.get("content"))}
    if message["role"] == "assistant":
        out["tool_calls"] = [[c["function"]["name"], _decoded(c["function"].get("arguments"))]
                             for c in message.get("tool_calls") or ()]
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


def _decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _tools_key(tools: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True, ensure_ascii=False)


class _StreamingEngine(Protocol):
    """An engine whose ``generate`` calls ``on_token(token_id, logprob, policy_version)`` as it samples
    (:func:`streams_tokens` tells)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int, float, int], object]) -> Generation: ...


def streams_tokens(engine: InferenceEngine) -> bool:
    """True when ``engine.generate`` takes ``on_token`` (the HF engine): tokens stream as sampled."""
    try:
        return "on_token" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class _Plan:
    """Where a request's reply goes: the segment it extends (None: a fresh render) and the tokens."""

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


@dataclass
class _Sampled:
    """One choice as sampled: the generation, its text (special tokens skipped, as content is shown)
    and the text the parser reads (special tokens kept for a family parser whose call markers are
    special tokens; the same text otherwise)."""

    gen: Generation
    text: str
    parsed_text: str = ""
    stop_string: str | None = None


@dataclass
class AgentSession:
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

    # -- planning -------------------------------------------------------------------------
    def _plan(self, req: ChatRequest) -> _Plan:
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
            return _Plan(base, base.version, state, prompt, tuple(delta), tuple(new), (), convo, tools_key)
        try:
            rendered = self.renderer.render_prompt(self._as_template_messages(req.messages), req.tools)
        except Exception as exc:
            raise RequestError(f"messages cannot be rendered by the policy's chat template: "
                               f"{type(exc).__name__}: {exc}", "messages") from exc
        return _Plan(None, 0, (0, 0, 0, True), rendered.token_ids, rendered.token_ids, (), rendered.messages, convo,
                     tools_key)

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
                calls = "".join(_call_text(self.parser, c) for c in m["tool_calls"])
                text = text_of(m.get("content"))
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
            elif m["role"] == "tool" and self.renderer.tool_role == "user":
                out.append({"role": "user", "content": f"<tool_response>\n{text_of(m.get('content'))}\n</tool_response>"})
            else:
                out.append({k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")})
        return out

    def _sampling(self, req: ChatRequest, plan: _Plan, notes: dict[str, str] | None = None) -> SamplingParams:
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
        mode = req.tool_choice.mode
        if mode not in ("required", "function"):
            return ""
        opening = _call_opening(self.parser)
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

    # -- answering ------------------------------------------------------------------------
    async def _answer(self, req: ChatRequest, plan: _Plan, params: SamplingParams, turn: int,
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

    async def _sample(self, index: int, prompt: list[int], params: SamplingParams, markers: list[tuple[str, bool]],
                      forced_text: str, on_text: OnText | None) -> _Sampled:
        """One choice: the engine's generation, cut at the first marker, and its text (forced opening included)."""
        tokens: list[int] = []
        lps: list[float] = []
        version = [self.engine.policy_version]
        loop = asyncio.get_running_loop()
        hit: asyncio.Future = loop.create_future()
        detok = IncrementalText(self._decode)

        def push(tok: int, lp: float, v: int) -> None:
            if hit.done():
                return
            tokens.append(tok)
            lps.append(lp)
            version[0] = v
            text = forced_text + detok.push(tok)
            cut = _marker_cut(text, markers)
            if cut is not None:
                hit.set_result(len(tokens))
            if on_text is not None:
                on_text(index, text if cut is None else text[:cut])

        if self._streams and (markers or on_text is not None):
            gen_task = asyncio.ensure_future(cast(_StreamingEngine, self.engine).generate(
                prompt, params, on_token=lambda t, lp, v: loop.call_soon_threadsafe(push, t, lp, v)))
            try:
                await asyncio.wait({gen_task, hit}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                gen_task.cancel()
                raise
            if gen_task.done():
                gen = gen_task.result()
            else:  # a stop marker was sampled: abort the row, keep what it sampled
                gen_task.cancel()
                gen_task.add_done_callback(lambda t: t.cancelled() or t.exception())
                gen = Generation(tuple(tokens), tuple(lps), "stop", version[0])
        else:  # nothing to watch token by token (or the engine cannot stream): one call
            gen = await self.engine.generate(prompt, params)
            if on_text is not None:
                on_text(index, forced_text + self._decode(gen.token_ids))
        gen = self._cut(gen, markers, forced_text)
        text = forced_text + self._decode(gen.token_ids)
        cut = _marker_cut(text, markers)
        parsed = forced_text + self._parse_decode(gen.token_ids)
        parsed_cut = _marker_cut(parsed, markers)
        return _Sampled(gen, text if cut is None else text[:cut], parsed if parsed_cut is None else parsed[:parsed_cut],
                        _stop_hit(text, markers))

    def _cut(self, gen: Generation, markers: list[tuple[str, bool]], forced_text: str) -> Generation:
        """``gen`` up to the token that completes the first marker (finish reason "stop"), or as is."""
        if not markers or _marker_cut(forced_text + self._decode(gen.token_ids), markers) is None:
            return gen
        for k in range(1, len(gen.token_ids) + 1):
            if _marker_cut(forced_text + self._decode(gen.token_ids[:k]), markers) is not None:
                break
        if k == len(gen.token_ids) and gen.finish_reason == "stop":
            return gen
        routes = gen.routed_experts[:k] if gen.routed_experts is not None else None
        return Generation(gen.token_ids[:k], gen.logprobs[:k], "stop", gen.policy_version, routes)

    def _record(self, req: ChatRequest, plan: _Plan, s: _Sampled, forced: tuple[int, ...], index: int,
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
        parent = plan.base.replies[plan.base.marks.index(plan.base_state)] if plan.base is not None else None
        on_task = parent.on_task if parent is not None else self._holds_task(plan.convo)
        reply = Reply(len(self.replies), request, index, seg, seg.state(), parent, choice.content or "",
                      len(s.gen.token_ids), on_task)
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

    def _segment_for(self, plan: _Plan, index: int) -> Segment:
        """Choice 0 extends the planned segment in place when nobody extended it meanwhile; otherwise
        (and for siblings) a copy of the planned prefix becomes a new segment."""
        if plan.base is None:
            kind = "first" if not self.segments else ("sibling" if index else "branch")
            seg = Segment(TrajectoryRecorder(self.spec), [], plan.tools_key, kind=kind)
        elif index == 0 and plan.base.version == plan.base_version and plan.base.state() == plan.base_state:
            return plan.base
        else:
            seg = plan.base.fork(plan.base_state, "sibling" if index else "branch")
        if seg.kind == "branch":
            self.stats.branches += 1
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
        parsed = self.parser.parse(parsed_text)
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

    # -- the episode's records ----------------------------------------------------------------
    def final_reply(self, answer: str | None = None) -> Reply | None:
        """The last reply of the trained chain (see the module doc); None before any reply.

        Args:
            answer: the agent's own final answer (output file): the chain ends at the latest
                delivered reply whose content is that text, when there is one.
        """
        if not self.replies:
            return None
        if answer is not None and answer.strip():
            named = [r for r in self.replies if r.delivered is not False and r.content.strip() == answer.strip()]
            if named:
                return named[-1]
        heights: dict[int, int] = {}

        def height(r: Reply) -> int:
            if id(r) not in heights:
                heights[id(r)] = 1 + max((height(c) for c in r.children), default=0)
            return heights[id(r)]

        roots = [r for r in self.replies if r.parent is None]
        node = max(roots, key=lambda r: (r.on_task, height(r), r.delivered is not False, -r.order))
        while node.children:
            node = max(node.children, key=lambda c: (height(c), c.delivered is not False, c.request, -c.choice))
        return node

    @property
    def primary(self) -> Segment | None:
        """The segment holding the trained chain's last reply (None before any reply)."""
        final = self.final_reply()
        return final.segment if final is not None else None

    def trained(self, answer: str | None = None) -> TrajectoryRecorder | None:
        """The trained chain's record: its segment cut back to right after :meth:`final_reply`
        (prompt, the kept replies with their log-probs, the deltas between them); None before any reply."""
        final = self.final_reply(answer)
        if final is None:
            return None
        seg = final.segment
        rec = seg.rec if final.state == seg.state() else seg.fork(final.state, seg.kind).rec
        rec.spec = self.spec
        return rec

    def recorders(self, answer: str | None = None) -> list[TrajectoryRecorder]:
        """The trained chain's record first (the episode's sample id), then every other segment with
        a turn (side branches, not trained), as ``{sample_id}/seg{k}``."""
        first = self.trained(answer)
        if first is None:
            return []
        out = [first]
        for seg in self.segments:
            if seg.rec is first or not seg.rec.turns:
                continue
            seg.rec.spec = dataclasses.replace(self.spec, sample_id=f"{self.spec.sample_id}/seg{len(out)}")
            out.append(seg.rec)
        return out

    def metrics(self, answer: str | None = None) -> dict[str, float]:
        """The ``agent/*`` metrics of the episode (``answer``: as for :meth:`final_reply`).

        ``agent/replies``: replies sampled; ``agent/chain_replies``: those in the trained chain;
        ``agent/dropped_replies`` / ``agent/dropped_tokens``: replies (sampled tokens) off the chain,
        not trained; ``agent/undelivered``: replies whose response the agent had hung up on.
        """
        s = self.stats
        final = self.final_reply(answer)
        chain = final.chain() if final is not None else []
        dropped = [r for r in self.replies if all(r is not c for c in chain)]
        return {"agent/requests": float(s.requests), "agent/replayed": float(s.replayed),
                "agent/branches": float(s.branches), "agent/siblings": float(s.siblings),
                "agent/tool_parse_failures": float(s.tool_parse_failures), "agent/aborted": float(s.aborted),
                "agent/segments": float(sum(1 for seg in self.segments if seg.rec.turns)),
                "agent/replies": float(len(self.replies)), "agent/chain_replies": float(len(chain)),
                "agent/dropped_replies": float(len(dropped)),
                "agent/dropped_tokens": float(sum(r.num_tokens for r in dropped)),
                "agent/undelivered": float(sum(r.delivered is False for r in self.replies)),
                "agent/duplicate_replies": float(s.duplicate_replies),
                "agent/capped_max_tokens": float(s.capped_max_tokens)}


class IncrementalText:
    """The text of a growing list of token ids, decoding only a short window at its end per token
    (constant work per token instead of re-decoding the whole reply), after vLLM's incremental
    detokenization (``detokenize_incrementally``: a prefix window decoded with and without the new
    tokens; text is released only once it no longer ends in a partial UTF-8 character).

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; the text so far (its last partial character held back)."""
        self.ids.append(token_id)
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level BPE alphabet (``bytes_to_unicode`` of its reference
    implementation, openai/gpt-2 ``encoder.py``): printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> tuple[bytes, ...]:
    """[n] the raw bytes of each token (a token may hold part of a UTF-8 character, which its own
    decoded text cannot show): byte-level BPE pieces mapped back through GPT-2's byte alphabet,
    SentencePiece byte pieces (``<0xE2>``) as that byte, other pieces as their decoded text's UTF-8."""
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True):
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                out.append(bytes([int(piece[3:5], 16)]))
                continue
            except ValueError:
                pass
        if isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
            out.append(bytes(_BYTE_DECODER[ch] for ch in piece))
        else:
            out.append(tokenizer.decode([i]).encode())
    return tuple(out)


def _marker_cut(text: str, markers: list[tuple[str, bool]]) -> int | None:
    """End of the reply's text at the earliest marker (before a stop string, after a kept tag), or None."""
    best: tuple[int, int] | None = None
    for marker, keep in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(marker) if keep else i)
    return None if best is None else best[1]


def _stop_hit(text: str, markers: list[tuple[str, bool]]) -> str | None:
    """The stop string (a marker not kept) that ends ``text`` at the earliest marker, or None."""
    found = [(i, marker) for marker, keep in markers if (i := text.find(marker)) >= 0]
    if not found:
        return None
    i, marker = min(found)
    return None if dict(markers)[marker] else marker


def _call_opening(parser: ToolCallParser) -> str | None:
    """The text every call of ``parser``'s format starts with, up to the function name; None if unknown."""
    if isinstance(parser, HermesParser):
        return HermesParser.OPEN + '\n{"name": "'
    if isinstance(parser, FencedJsonParser):
        return '```json\n{"name": "'
    if isinstance(parser, JsonParser):
        return '{"name": "'
    return None


def _call_text(parser: ToolCallParser, call: dict[str, Any]) -> str:
    """One OpenAI tool call written in ``parser``'s format (for re-rendering edited history)."""
    body = json.dumps({"name": call["function"]["name"], "arguments": _decoded(call["function"].get("arguments"))},
                      ensure_ascii=False)
    if isinstance(parser, FencedJsonParser):
        return f"```json\n{body}\n```"
    if isinstance(parser, JsonParser):
        return body
    if getattr(parser, "family", None) and not isinstance(parser, HermesParser) and hasattr(parser, "format"):
        return parser.format([{"name": call["function"]["name"], "arguments": _decoded(call["function"].get("arguments"))}])
    return f"{HermesParser.OPEN}\n{body}\n{HermesParser.CLOSE}"
