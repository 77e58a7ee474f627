"""The degenerate policies of ``relax-agent envs audit`` (:mod:`relax_agent.envaudit`).

Each :class:`Policy` writes the text of one assistant reply from what it sees (:class:`Turn`):
nothing, the prompt echoed, junk, tool calls with wrong-typed or no arguments, calls of a tool
that does not exist, an uninformed answer in a common format, or only the words a lenient scorer
may look for. Tool calls are written in the run's tool-call format (the parser's ``format``), so the
parser reads them back as calls. Every reply is a function of the policy, the episode index and
the turn (random strings come from a generator seeded by them): two audits play the same replies.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import ConfigError

CLAIMS = {"correct": "correct", "pass": "PASS", "solved": "solved", "empty_tag": "<answer></answer>",
          "sentence": "The answer is correct."}
"""What a lenient scorer may look for in a reply: each ``claim:*`` policy writes only one of these."""

GUESSES = {
    "tag": "<answer>0</answer>", "colon": "Answer: 1", "boxed": "\\boxed{1}", "yes": "yes", "true": "true",
    "json": '{"answer": 0}', "letter": "A", "bracket": "[1]",
}
"""The ``guess:*`` policies: an answer in a format scorers commonly accept, with an uninformed value."""

SPRAY = "<answer>" + " ".join([*map(str, range(101)), "yes", "no", "true", "false", "A", "B", "C", "D"]) + "</answer>"
"""The ``guess:spray`` reply: every integer 0..100, yes/no, true/false and A-D inside one answer tag (earns
from a scorer that looks for the target anywhere in the answer)."""

JUNK_CHARS = 2000
"""Length of the ``junk`` policy's reply."""

_SYLLABLES = ("ka", "zu", "mor", "tel", "qi", "vex", "lo", "pra", "dun", "sy", "orb", "nex", "wa", "ji", "ul")
_PUNCT = (".", ",", ";", "!", "?", "-", "/", "*", "(", ")", "#", "@", "~")
UNDECLARED_TOOL = "undeclared_tool"
"""The tool name the ``tool:undeclared`` policy calls (no env declares it)."""


@dataclass(frozen=True)
class Turn:
    """What a policy sees before it writes one reply.

    Attributes:
        messages: the conversation so far (the env's observations and the policy's earlier replies).
        tools: the tool schemas the env declared at ``reset``.
        turn: 0 for the first reply.
        episode: the episode's index in the audit (its reset seed is ``seed + episode``).
        write_calls: writes ``[{"name", "arguments"}]`` as reply text in the run's tool-call format.
    """

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]]
    turn: int
    episode: int
    write_calls: Callable[[list[dict[str, Any]]], str]

    def rng(self, policy: str) -> random.Random:
        """A generator seeded by ``policy``, the episode and the turn (the same on every run)."""
        return random.Random(f"{policy}/{self.episode}/{self.turn}")


@dataclass(frozen=True)
class Policy:
    """One degenerate policy.

    Attributes:
        name: e.g. ``"empty"``, ``"guess:boxed"``.
        description: what it writes, in a few words.
        reply: the reply text for a :class:`Turn`.
        needs_tools: True when it calls the env's declared tools (an episode without any is skipped).
    """

    name: str
    description: str
    reply: Callable[[Turn], str]
    needs_tools: bool = False


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text: its string content, or its text parts joined by newlines."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text of the last user message (of the last message when there is no user message)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    return message_text(messages[-1]) if messages else ""


def junk(rng: random.Random, chars: int = JUNK_CHARS) -> str:
    """``chars`` characters of random pseudo-words, numbers and punctuation."""
    words: list[str] = []
    size = 0
    while size < chars:
        kind = rng.random()
        if kind < 0.7:
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        elif kind < 0.85:
            word = str(rng.randint(0, 99999))
        else:
            word = rng.choice(_PUNCT)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def garbage_value(prop: Any, rng: random.Random) -> Any:
    """A value of the wrong JSON type for the schema property ``prop`` (a random string where the
    schema wants a number, a number where it wants a string, ...)."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    word = "".join(rng.choice(_SYLLABLES) for _ in range(4)) + rng.choice(_PUNCT)
    if kind == "string":
        return rng.randint(100000, 999999)
    if kind == "boolean":
        return f"perhaps-{word}"
    if kind == "array":
        return {"not": word}
    if kind == "object":
        return [word]
    return word  # integer, number, null and untyped properties: a random string


def random_value(prop: Any, rng: random.Random) -> Any:
    """A value of the right JSON type for the schema property ``prop``, with random content (one of its
    ``enum`` values when it lists them)."""
    if isinstance(prop, dict) and isinstance(prop.get("enum"), list) and prop["enum"]:
        return rng.choice(prop["enum"])
    kind = prop.get("type") if isinstance(prop, dict) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5)))
    if kind == "integer":
        return rng.randint(-1000, 1000)
    if kind == "number":
        return round(rng.uniform(-1000, 1000), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_value(prop.get("items") or {"type": "string"}, rng)]
    if kind == "object":
        return {word: rng.randint(0, 9)}
    return word  # strings and untyped properties


def garbage_arguments(schema: dict[str, Any], rng: random.Random,
                      value: Callable[[Any, random.Random], Any] = garbage_value) -> dict[str, Any]:
    """``value(prop, rng)`` for every property a tool schema declares (wrong-typed values by default; one
    ``"value"`` argument when it declares none)."""
    params = schema.get("function", schema).get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict) or not props:
        return {"value": value({}, rng)}
    return {name: value(prop, rng) for name, prop in props.items()}


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    """The function names of OpenAI tool schemas, in order."""
    names = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def _calls_then_stop(make_calls: Callable[[Turn], list[dict[str, Any]]]) -> Callable[[Turn], str]:
    """A reply function that makes ``make_calls``'s calls in the first turn, then replies empty."""
    def reply(t: Turn) -> str:
        return t.write_calls(make_calls(t)) if t.turn == 0 else ""
    return reply


def _garbage_calls(t: Turn) -> list[dict[str, Any]]:
    rng = t.rng("tool:garbage")
    return [{"name": n, "arguments": garbage_arguments(s, rng)} for n, s in zip(tool_names(t.tools), t.tools, strict=False)]


def _random_calls(t: Turn) -> list[dict[str, Any]]:
    rng = t.rng("tool:random")
    return [{"name": n, "arguments": garbage_arguments(s, rng, random_value)}
            for n, s in zip(tool_names(t.tools), t.tools, strict=False)]


def _repeat_call(t: Turn) -> str:
    first = Turn(t.messages, t.tools[:1], 0, t.episode, t.write_calls)  # turn 0's generator: the same call every turn
    return t.write_calls(_garbage_calls(first)[:1])


def _constant(text: str) -> Callable[[Turn], str]:
    """A reply function that always writes ``text``."""
    return lambda t: text


def _policies() -> list[Policy]:
    out = [
        Policy("empty", "an empty reply", lambda t: ""),
        Policy("echo", "the last user message echoed back", lambda t: last_user_text(t.messages)),
        Policy("echo:answer", "the last user message inside <answer></answer> and after 'Answer:'",
               lambda t: f"<answer>{last_user_text(t.messages)}</answer>\nAnswer: {last_user_text(t.messages)}"),
        Policy("junk", f"{JUNK_CHARS} characters of random words, numbers and punctuation",
               lambda t: junk(t.rng("junk"))),
        Policy("tool:garbage", "one call to every declared tool with wrong-typed arguments, then an empty reply",
               _calls_then_stop(_garbage_calls), needs_tools=True),
        Policy("tool:random", "one call to every declared tool with well-typed random arguments (random strings, "
               "numbers, an enum's values), then an empty reply", _calls_then_stop(_random_calls), needs_tools=True),
        Policy("tool:empty_args", "one call to every declared tool with {} arguments, then an empty reply",
               _calls_then_stop(lambda t: [{"name": n, "arguments": {}} for n in tool_names(t.tools)]), needs_tools=True),
        Policy("tool:repeat", "the first declared tool called with the same wrong-typed arguments every turn",
               _repeat_call, needs_tools=True),
        Policy("tool:undeclared", f"a call to {UNDECLARED_TOOL!r}, which the env does not declare, then an empty reply",
               _calls_then_stop(lambda t: [{"name": UNDECLARED_TOOL, "arguments": {"query": "anything"}}])),
    ]
    for key, text in GUESSES.items():
        out.append(Policy(f"guess:{key}", f"only {text!r}", _constant(text)))
    out.append(Policy("guess:all", "every guess format at once, one per line", lambda t: "\n".join(GUESSES.values())))
    out.append(Policy("guess:spray", "0..100, yes/no, true/false and A-D in one answer tag", _constant(SPRAY)))
    for key, text in CLAIMS.items():
        out.append(Policy(f"claim:{key}", f"only {text!r}", _constant(text)))
    out.append(Policy("claim:all", "every success string at once, one per line", lambda t: "\n".join(CLAIMS.values())))
    return out


POLICIES: tuple[Policy, ...] = tuple(_policies())
"""Every degenerate policy, in report order. A policy replies the same way on every turn the
episode lasts, except the ``tool:`` policies that call once and then reply empty."""


def select_policies(names: Sequence[str] | None) -> list[Policy]:
    """The policies named (a name ending in ``:`` or ``*`` selects a family, e.g. ``guess:``); all without names.

    Raises:
        ConfigError: a name matches no policy.
    """
    if not names:
        return list(POLICIES)
    chosen: list[Policy] = []
    for name in names:
        family = name.endswith((":", "*"))
        prefix = name.rstrip("*")
        hits = [p for p in POLICIES if (p.name.startswith(prefix) if family else p.name == name)]
        if not hits:
            raise ConfigError(f"--policy {name!r}: no such policy; expected one of {[p.name for p in POLICIES]} "
                              "or a family prefix such as 'guess:'")
        chosen += [p for p in hits if p not in chosen]
    return [p for p in POLICIES if p in chosen]  # report order


__all__ = ["CLAIMS", "GUESSES", "JUNK_CHARS", "POLICIES", "SPRAY", "UNDECLARED_TOOL", "Policy", "Turn", "garbage_arguments",
           "garbage_value", "junk", "last_user_text", "message_text", "random_value", "select_policies",
           "tool_names"]
