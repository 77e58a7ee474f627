"""``relax-agent agent check``: a conformance check of an agent program before any training.

The program runs exactly as ``rollout.driver: agent`` runs it (its own process group, the same
environment variables), once per task, against the real endpoint on 127.0.0.1 — but the policy
is scripted (:class:`ScriptedPolicy`): to a request with tools and no tool result yet it answers
with a well-formed call of the first offered tool (arguments from the schema), otherwise with
the final answer :data:`FINAL_ANSWER`. Nothing is trained and no model weights are loaded (only
the tokenizer, for the chat template). :func:`check_agent` returns one :class:`CheckRow` per
property training relies on, each with the fix when it fails:

- ``runs``: the program exits 0 within the timeout, with a valid output file if any;
- ``requests``: it calls the endpoint (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, or the ``ANTHROPIC_*`` pair);
- ``accepted``: no request was refused (4xx; the endpoint's message says why);
- ``tools sent``: every request offers the task's tools;
- ``tool calls answered``: a tool call is answered by a ``tool`` message with its id;
- ``history verbatim``: the history is sent back as received, so sampled tokens are reused
  exactly (a rewritten history is re-rendered: a branch, not the trained chain);
- ``no fixed seed``: requests set no ``seed`` (the endpoint mixes it, other servers do not);
- ``nothing dropped``: no reply off the trained chain (abandoned requests, side calls) — a
  warning: such replies are recorded but never trained;
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

from relax_agent.errors import RelaxError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import Deadline, EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.rollout.proxy.openai_api import ChatRequest
from relax_agent.rollout.proxy.session import AgentSession
from relax_agent.rollout.proxy.session.calls import call_text

FINAL_ANSWER = "Answer: 42"
"""What the scripted policy answers once no tool call is pending."""

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


@dataclass
class CheckSession(AgentSession):
    """An :class:`AgentSession` that keeps every request it accepted and scripts the policy's reply to it."""

    seen: list[ChatRequest] = field(default_factory=list)

    async def submit(self, req: ChatRequest, body_key: str, replay: bool, on_text: Any = None,
                     notes: dict[str, str] | None = None, info: dict[str, int] | None = None) -> asyncio.Future:
        """Keep ``req`` and script the reply before submitting it: a call of the first allowed tool
        while tools are offered and none has answered yet, else the final answer."""
        self.seen.append(req)
        assert isinstance(self.engine, ScriptedPolicy)
        answered = any(m["role"] == "tool" for m in req.messages)
        if req.tools and req.tool_choice.mode != "none" and not answered:
            tools = [t for t in req.tools if req.tool_choice.mode != "function"
                     or t["function"]["name"] == req.tool_choice.name]
            text = call_text(self.parser, call_of(tools[0]))
            forced = self._forced_text(req)
            self.engine.text = text[len(forced):] if forced and text.startswith(forced) else text
        else:
            self.engine.text = FINAL_ANSWER
        return await super().submit(req, body_key, replay, on_text, notes, info)


async def check_agent(cfg: Any, tasks: Sequence[CheckTask], renderer: ChatRenderer, parser: ToolCallParser,
                      max_new_tokens: int = 256) -> list[CheckRow]:
    """Run the agent program of ``cfg`` (a :class:`~relax_agent.config.AgentConfig`) on each task against
    the scripted policy; the rows of the module doc, each judged over all tasks.

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
            spec = EpisodeSpec(f"{task.id}/{k}", task.id, task.id, dict(task.metadata), seed=k)
            session = CheckSession(spec, f"check-{k}-{id(driver)}", engine, renderer, parser,
                                   SamplingParams(max_new_tokens=max_new_tokens), cfg.honor_request_sampling,
                                   cfg.model_name, task_messages=task.messages)
            before = len(driver.server.refused)
            driver.server.open(session)
            error: Exception | None = None
            output: dict[str, Any] = {}
            try:
                with tempfile.TemporaryDirectory(prefix="relax-agent-check-") as tmp:
                    output = await driver._run_agent(Path(tmp), spec, list(task.messages), list(task.tools), session,
                                                     Deadline(cfg.timeout_s))
            except RelaxError as exc:
                error = exc
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
            runs.append((task, session, error, refused, reward, score_error))
    finally:
        driver.close()
    return _rows(runs)


def _rows(runs: list[Any]) -> list[CheckRow]:
    rows = []
    n = len(runs)

    def row(name: str, bad: list[str], fix: str, warn: bool = False, ok: str = "") -> None:
        status = "pass" if not bad else ("warn" if warn else "fail")
        rows.append(CheckRow(name, status, bad[0] if bad else (ok or f"{n}/{n} tasks"), fix if bad else ""))

    errors = [f"{t.id}: {e}" for t, _, e, *_ in runs if e is not None]
    row("runs", errors, "make the program exit 0 within rollout.agent.timeout_s; its stderr is quoted above")
    requests = sum(len(s.seen) for _, s, *_ in runs)
    row("requests", [f"{t.id}: no request to the endpoint" for t, s, *_ in runs if not s.seen],
        "call the endpoint in OPENAI_BASE_URL with OPENAI_API_KEY (OpenAI() reads both from the environment; "
        "Anthropic() reads ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY)",
        ok=f"{requests} requests over {n} tasks")
    row("accepted", [f"{t.id}: {r[0]}" for t, _, _, r, *_ in runs if r],
        "send only what the endpoint honours (the message names the field); see docs/guides/agents.md")
    row("tools sent", [f"{t.id}: request {i} offered {len(q.tools)} of the task's {len(t.tools)} tools"
                       for t, s, *_ in runs if t.tools for i, q in enumerate(s.seen) if len(q.tools) < len(t.tools)][:1],
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
    row("history verbatim", [f"{t.id}: {s.stats.branches} request(s) rewrote the history (re-rendered: a branch)"
                             for t, s, *_ in runs if s.stats.branches],
        "append each reply as received (message.model_dump(exclude_none=True)) and send earlier turns unchanged; "
        "a rewritten history is re-tokenized and is not the trained chain")
    row("no fixed seed", [f"{t.id}: request {i} sets seed={q.seed}" for t, s, *_ in runs
                          for i, q in enumerate(s.seen) if q.seed is not None][:1],
        "drop seed: the endpoint mixes it with the episode's seed, but a fixed seed elsewhere makes every sample "
        "of a group the same")
    row("nothing dropped", [f"{t.id}: {int(s.metrics()['agent/dropped_replies'])} replies off the trained chain "
                            f"(abandoned requests, side calls, unchosen choices)"
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
