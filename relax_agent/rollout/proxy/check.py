"""``relax-agent agent check``: a conformance check of an agent program before any training.

The program runs exactly as ``rollout.driver: agent`` runs it (its own process group, the same
environment variables), once per task, against the real endpoint on 127.0.0.1 — but the policy
is scripted (:class:`ScriptedPolicy`): to a request with tools and no tool result yet it answers
with :data:`CALL_TEXT` beside a well-formed call of the first offered tool (arguments from the
schema; the call alone when ``tool_choice`` forces its opening), otherwise with the final answer
:data:`FINAL_ANSWER`. Nothing is trained and no model weights are loaded (only the tokenizer, for
the chat template). Each task is bounded by the agent's timeout (its process group is killed
past it) and any failure of a task is a row, never a crash: the remaining tasks still run.
:func:`check_agent` returns one :class:`CheckRow` per property training relies on, each with the
fix when it fails:

- ``runs``: the program starts and exits 0;
- ``timeout``: it exits within ``rollout.agent.timeout_s``;
- ``output file``: ``RELAX_OUTPUT_FILE``, when written, holds a JSON object;
- ``requests``: it calls the endpoint (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, or the ``ANTHROPIC_*`` pair);
- ``accepted``: no request was refused (4xx; the endpoint's message says why);
- ``tools sent``: every request on the task offers the task's tools (side calls excluded);
- ``tool calls answered``: a tool call is answered by a ``tool`` message with its id;
- ``history verbatim``: the history is sent back as received, so sampled tokens are reused
  exactly. A history that still holds every reply re-templated (whitespace changed, text added
  around it) is a warning: it trains, as a new context per such request, re-rendered; one that
  lost a reply (rewritten, summarised, the text beside tool calls dropped) fails: it is a branch
  the replies before it do not train with;
- ``no fixed seed``: requests set no ``seed`` (the endpoint mixes it, other servers do not);
- ``nothing dropped``: no reply off the trained chain (abandoned requests, side calls such as a
  title, named as such) — a warning: such replies are recorded but never trained;
- ``final answer``: the trained chain ends at the final answer (scored, when an env scores).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import Deadline, EpisodeSpec, EpisodeTimeout
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.rollout.proxy.openai_api import ChatRequest
from relax_agent.rollout.proxy.session import AgentSession, Reply, normalise
from relax_agent.rollout.proxy.session.calls import call_text, content_key, continues
from relax_agent.rollout.recorder import failure_cause

FINAL_ANSWER = "Answer: 42"
"""What the scripted policy answers once no tool call is pending."""
CALL_TEXT = "I will use a tool."
"""The text the scripted policy writes before its tool call (an agent must send it back with the call)."""

CHECK_TASK: dict[str, Any] = {
    "id": "check-add", "sample_id": "check-add/0",
    "messages": [{"role": "system", "content": "You are a helpful assistant. Use the tools you are given."},
                 {"role": "user", "content": "What is 17 + 25?"}],
    "tools": [{"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}}],
    "metadata": {"expression": "17 + 25", "answer": 42},
}
"""The task used when no env gives tasks: one tool, one question."""


@dataclass(frozen=True)
class CheckRow:
    """One line of the check: ``status`` "pass", "warn" or "fail", what was seen, and the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class CheckTask:
    """A task the program plays: its opening ``messages``, ``tools``, the task dict (``metadata``)
    and, when an env scores, ``score(answer_message) -> reward``."""

    id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    metadata: dict[str, Any]
    score: Callable[[dict[str, Any]], float] | None = None


class ScriptedPolicy:
    """The check's "engine": samples the tokens of :attr:`text` (then end of sequence), log-prob -1 each.

    Args:
        tokenizer: the policy's tokenizer (for the ids of the text).
    """

    policy_version = 0

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = FINAL_ANSWER
        eos = tokenizer.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, on_token: Any = None) -> Generation:
        """The tokens of :attr:`text` then end of sequence (at most ``max_new_tokens``), log-prob -1 each,
        streamed to ``on_token``."""
        ids = list(self.tokenizer(self.text, add_special_tokens=False)["input_ids"]) + [self.eos]
        ids = ids[:params.max_new_tokens]
        for t in ids:
            await asyncio.sleep(0)
            if on_token is not None:
                on_token(t, -1.0, 0)
        return Generation(tuple(ids), tuple(-1.0 for _ in ids), "stop" if ids[-1] == self.eos else "length", 0)

    def load_weights(self, state_dict: Any, version: int) -> None:
        """Nothing: the scripted policy has no weights."""
        pass

    def close(self) -> None:
        """Nothing to release."""
        pass


def _dummy(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    dummies: dict[Any, Any] = {"number": 1, "integer": 1, "string": "x", "boolean": True, "array": [], "object": {}}
    return dummies.get(kind, "x")


def call_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A well-formed call of ``tool`` (OpenAI format): its required arguments with schema-typed values."""
    fn = tool["function"]
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    args = {k: _dummy(props.get(k, {})) for k in params.get("required", list(props))}
    return {"id": "call_check", "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}


@dataclass(frozen=True)
class HistoryNote:
    """How request ``request`` of a task departs from sending its history back verbatim: ``kind`` "side
    call" (its messages do not hold the task), "re-templated" (every reply still there: a new context)
    or "rewritten" (a reply lost: a branch); ``what`` says which message and how."""

    request: int
    kind: str
    what: str


@dataclass
class CheckSession(AgentSession):
    """An :class:`AgentSession` that keeps every request it accepted, notes how each departs from a
    verbatim history, and scripts the policy's reply to it."""

    seen: list[ChatRequest] = field(default_factory=list)
    notes: list[HistoryNote] = field(default_factory=list)

    async def submit(self, req: ChatRequest, body_key: str, replay: bool, on_text: Any = None,
                     notes: dict[str, str] | None = None, info: dict[str, int] | None = None) -> asyncio.Future:
        """Keep ``req``, note its history, and script the reply before submitting it: :data:`CALL_TEXT`
        and a call of the first allowed tool while tools are offered and none has answered yet, else
        the final answer."""
        self.seen.append(req)
        note = self._history_note(req)
        if note is not None:
            self.notes.append(HistoryNote(len(self.seen) - 1, *note))
        assert isinstance(self.engine, ScriptedPolicy)
        answered = any(m["role"] == "tool" for m in req.messages)
        if req.tools and req.tool_choice.mode != "none" and not answered:
            tools = [t for t in req.tools if req.tool_choice.mode != "function"
                     or t["function"]["name"] == req.tool_choice.name]
            text = call_text(self.parser, call_of(tools[0]))
            forced = self._forced_text(req)
            self.engine.text = text[len(forced):] if forced and text.startswith(forced) else f"{CALL_TEXT}\n{text}"
        else:
            self.engine.text = FINAL_ANSWER
        return await super().submit(req, body_key, replay, on_text, notes, info)

    def _history_note(self, req: ChatRequest) -> tuple[str, str] | None:
        """(kind, what) of :class:`HistoryNote` for ``req``, or None when it sends the history back
        verbatim (other ``tools`` aside: the ``tools sent`` row judges those) or starts afresh."""
        convo = tuple(normalise(m) for m in req.messages)
        if not self._holds_task(convo):
            return "side call", "its messages do not hold the task's (a side call, e.g. a title): recorded, not trained"
        if not self.segments or any(self._extends(convo, seg.tools_key) for seg in self.segments):
            return None
        assistant = [m for m in req.messages if m.get("role") == "assistant"]
        if not assistant:
            return None  # a new conversation on the task (a retry, another attempt)
        for k, message in enumerate(assistant):
            change = _change(message, list(self.replies))
            if change is not None:
                return change[0], f"assistant message {k} {change[1]}"
        return "rewritten", "changed a message that is not one of the policy's replies (system, user or tool)"


def _change(message: dict[str, Any], replies: list[Reply]) -> tuple[str, str] | None:
    """How ``message`` (an assistant message sent back) differs from the reply it stands for: None when
    it is one exactly (as normalised), else (kind, what) as in :class:`HistoryNote`."""
    sent = content_key(message)
    exact = normalise(message)
    if any(r.segment.convo[r.state[1] - 1] == exact for r in replies):
        return None
    for r in reversed(replies):
        how = continues(sent, r.key)
        if how == 2:
            return "re-templated", f"is reply {r.order} with its whitespace changed"
        if how == 1:
            return "re-templated", f"holds reply {r.order} inside a longer text (annotated or prefixed)"
        if sent[1] == r.key[1] != "[]" and r.key[0] and not sent[0]:
            return "rewritten", f"is reply {r.order}'s tool calls without the text beside them ({r.content[:40]!r})"
    return "rewritten", "holds none of the policy's replies (rewritten or summarised)"


async def check_agent(cfg: Any, tasks: Sequence[CheckTask], renderer: ChatRenderer, parser: ToolCallParser,
                      max_new_tokens: int = 256) -> list[CheckRow]:
    """Run the agent program of ``cfg`` (a :class:`~relax_agent.config.AgentConfig`) on each task against
    the scripted policy; the rows of the module doc, each judged over all tasks. A task that fails in
    any way (the agent hangs past ``cfg.timeout_s``, crashes, writes a bad output file, the env cannot
    score) is a failed row; the remaining tasks still run.

    Raises:
        RelaxError: the endpoint could not start (e.g. ``cfg.port`` is taken).
    """
    from relax_agent.rollout.agent_driver import AgentDriver

    engine = ScriptedPolicy(renderer.tokenizer)
    driver = AgentDriver(lambda: None, engine, renderer, parser, cfg)
    runs: list[tuple[CheckTask, CheckSession, Exception | None, list[str], float | None, Exception | None]] = []
    try:
        driver.server.start()
        for k, task in enumerate(tasks):
            session = CheckSession(EpisodeSpec(f"{task.id}/{k}", task.id, task.id, dict(task.metadata), seed=k),
                                   f"check-{k}-{id(driver)}", engine, renderer, parser,
                                   SamplingParams(max_new_tokens=max_new_tokens), cfg.honor_request_sampling,
                                   cfg.model_name, task_messages=task.messages)
            runs.append(await _check_task(driver, task, session, cfg.timeout_s))
    finally:
        driver.close()
    return _rows(runs)


async def _check_task(driver: Any, task: CheckTask, session: CheckSession, timeout_s: float) -> tuple[Any, ...]:
    """Play ``task`` with the agent in ``session`` (bounded by ``timeout_s``); (task, session, the run's
    failure, refused requests' messages, the env's reward, the env's scoring failure). Never raises
    an :class:`Exception`: every failure is returned."""
    before = len(driver.server.refused)
    driver.server.open(session)
    error: Exception | None = None
    output: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="relax-agent-check-") as tmp:
            output = await driver.run_agent(Path(tmp), session.spec, list(task.messages), list(task.tools), session,
                                            Deadline(timeout_s))
    except Exception as exc:  # a timeout, a crash, a bad output file: a row, not a crash of the check
        error = exc
    finally:
        await driver.server.end(session)
    refused = [msg for key, msg in list(driver.server.refused)[before:] if key == session.key]
    reward, score_error = None, None
    final = session.trained(output.get("answer") if isinstance(output.get("answer"), str) else None)
    if task.score is not None and final is not None and error is None:
        try:
            last = next(m for m in reversed(final.messages) if m.get("role") == "assistant")
            reward = task.score({k2: v for k2, v in last.items() if k2 != "parse_errors"})
        except Exception as exc:  # the env's failure is a row, not a crash of the check
            score_error = exc
    return task, session, error, refused, reward, score_error


def _failure_kind(exc: Exception) -> str:
    """The row a task's failure belongs to: "timeout", "output file" or "runs"."""
    if isinstance(exc, EpisodeTimeout):
        return "timeout"
    return "output file" if "RELAX_OUTPUT_FILE" in str(exc) else "runs"


def _rows(runs: list[Any]) -> list[CheckRow]:
    rows = []
    n = len(runs)

    def row(name: str, bad: list[str], fix: str, warn: bool = False, ok: str = "") -> None:
        status = "pass" if not bad else ("warn" if warn else "fail")
        rows.append(CheckRow(name, status, bad[0] if bad else (ok or f"{n}/{n} tasks"), fix if bad else ""))

    failures = [(t, e) for t, _, e, *_ in runs if e is not None]
    for kind, fix in (("runs", "make the program start and exit 0; its stderr is quoted above"),
                      ("timeout", "make the program finish within rollout.agent.timeout_s (--timeout-s): end after "
                                  "the final answer, and bound its own loops and waits"),
                      ("output file", "write one JSON object {'answer': str, 'reward': float, 'metrics': {...}} to "
                                      "RELAX_OUTPUT_FILE, or nothing")):
        row(kind, [f"{t.id}: {failure_cause(e)}" for t, e in failures if _failure_kind(e) == kind], fix,
            ok=f"{n}/{n} tasks" if kind != "output file" else f"{n}/{n} tasks (written or not)")
    requests = sum(len(s.seen) for _, s, *_ in runs)
    row("requests", [f"{t.id}: no request to the endpoint" for t, s, *_ in runs if not s.seen],
        "call the endpoint in OPENAI_BASE_URL with OPENAI_API_KEY (OpenAI() reads both from the environment; "
        "Anthropic() reads ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY)",
        ok=f"{requests} requests over {n} tasks")
    row("accepted", [f"{t.id}: {r[0]}" for t, _, _, r, *_ in runs if r],
        "send only what the endpoint honours (the message names the field); see docs/guides/agents.md")
    row("tools sent", [f"{t.id}: request {i} offered {len(q.tools)} of the task's {len(t.tools)} tools"
                       for t, s, *_ in runs if t.tools for i, q in enumerate(s.seen)
                       if len(q.tools) < len(t.tools) and i not in _side_calls(s)][:1],
        "pass tools=task['tools'] (from RELAX_TASK_FILE) in every request")
    unanswered = []
    for t, s, *_ in runs:
        calls = {c["id"] for r in s.replies for c in _calls_of(s, r)}
        answered = {m.get("tool_call_id") for q in s.seen for m in q.messages if m["role"] == "tool"}
        if t.tools and s.seen and not calls & answered:
            unanswered.append(f"{t.id}: the policy called a tool; no later request answered the call"
                              if calls else f"{t.id}: no tool call was returned to the agent")
    row("tool calls answered", unanswered, "run each tool call and send the assistant message back followed by "
        "{'role': 'tool', 'tool_call_id': call.id, 'content': result}, then request again")
    history = [(t, note) for t, s, *_ in runs for note in s.notes if note.kind != "side call"]
    bad = [f"{t.id}: request {n.request} {n.what}" for t, n in history if n.kind == "rewritten"]
    bad += [f"{t.id}: request {n.request} {n.what}: a new context, re-rendered" for t, n in history
            if n.kind == "re-templated"]
    row("history verbatim", bad,
        "append each reply as received (message.model_dump(exclude_none=True): its text and its tool calls) and "
        "send earlier turns unchanged; a history that lost a reply is a branch the replies before it do not train "
        "with, a re-templated one trains as a new context per request, re-tokenized",
        warn=all(n.kind == "re-templated" for _, n in history))
    row("no fixed seed", [f"{t.id}: request {i} sets seed={q.seed}" for t, s, *_ in runs
                          for i, q in enumerate(s.seen) if q.seed is not None][:1],
        "drop seed: the endpoint mixes it with the episode's seed, but a fixed seed elsewhere makes every sample "
        "of a group the same")
    row("nothing dropped", [f"{t.id}: {int(s.metrics()['agent/dropped_replies'])} replies off the trained chain ("
                            + ("; ".join(f"request {n.request}: {n.what}" for n in s.notes if n.kind == "side call")
                               or "abandoned requests, side calls, unchosen choices") + ")"
                            for t, s, *_ in runs if s.metrics()["agent/dropped_replies"]],
        "replies the agent does not build on are recorded but never trained; avoid side calls, or write the "
        "answer to RELAX_OUTPUT_FILE", warn=True)
    finals = []
    for t, s, e, _, _reward, score_error in runs:
        final = s.final_reply()
        if e is None and s.seen and (final is None or final.content != FINAL_ANSWER):
            finals.append(f"{t.id}: the trained chain ends at {final.content[:60]!r}, not at the final answer"
                          if final is not None else f"{t.id}: no reply")
        elif score_error is not None:
            finals.append(f"{t.id}: the env could not score the final answer: {score_error}")
    rewards = [r[4] for r in runs if r[4] is not None]
    row("final answer", finals, "stop at the first reply without tool calls and build every request on the "
        "previous reply", ok=f"the chain ends at the final answer; rewards {rewards}" if rewards else "")
    return rows


def _side_calls(session: CheckSession) -> set[int]:
    """The requests of ``session`` whose messages do not hold the task."""
    return {n.request for n in session.notes if n.kind == "side call"}


def _calls_of(session: AgentSession, reply: Any) -> list[dict[str, Any]]:
    seg = reply.segment
    msgs = seg.rec.messages[:reply.state[2]]
    last = msgs[-1] if msgs else {}
    return [c for c in last.get("tool_calls") or () if "id" in c]


def format_rows(rows: Sequence[CheckRow]) -> str:
    """The table ``relax-agent agent check`` prints: status, check, what was seen; the fix under each failure."""
    width = max(len(r.name) for r in rows)
    out = []
    for r in rows:
        out.append(f"{r.status.upper():5} {r.name:<{width}}  {r.detail}")
        if r.fix:
            out.append(f"{'':5} {'':<{width}}  fix: {r.fix}")
    return "\n".join(out)
