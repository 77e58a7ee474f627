"""Real verifiers 0.4 (``verifiers.v1``) environments for the relax-agent bridge's tests, built with the
installed package only (no network, no runtime box):

* :func:`load_math`: single-turn arithmetic. The task's ``@vf.stop`` refuses a second turn (verifiers'
  reverse-text idiom); the rubric is two weighted ``@vf.reward`` functions over an XML/think parse of
  the reply (``correct``, weight 1.0: the ``<answer>`` outside ``<think>``, else verifiers'
  ``extract_boxed_answer``; ``format``, weight 0.2) and a ``@vf.metric``.
* :func:`load_lookup`: a tool task. A per-task ``vf.Toolset`` (``atlas_capital``, ``atlas_hint``; its
  ``setup_task`` sees the task row) serves the tools; the model looks a capital up, then answers:
  at least two model turns. Rewards: ``correct`` (1.0) and ``looked_up`` (0.5, a tool result held the
  answer).

``env.id: "verifiers:tests.e2e.data.vf_envs:load_math"`` plays one of them; the multi-turn env with a
scripted user (an ``Env.run``) is ``vf_dialogue.py``, loaded by name.
"""

from __future__ import annotations

import asyncio
import json
import re

import verifiers.v1 as vf

SYSTEM = "Think inside <think></think>, then give only the final answer inside <answer></answer>."
THINK = re.compile(r"<think>.*?</think>", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def parse_answer(text: str) -> str | None:
    """The reply's answer (the benchmark's own parse): the last ``<answer>`` outside the ``<think>`` block,
    else a ``\\boxed{}`` answer (verifiers' ``extract_boxed_answer``); None without either."""
    visible = THINK.sub("", text or "")
    tagged = ANSWER.findall(visible)
    if tagged:
        return tagged[-1].strip()
    boxed = vf.extract_boxed_answer(visible, strict=True)
    return boxed.strip() or None


def well_formed(text: str) -> bool:
    """One ``<think>`` block followed by one ``<answer>``."""
    return re.fullmatch(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", text or "", re.S) is not None


# -- single-turn arithmetic --------------------------------------------------------------------------
class MathData(vf.TaskData):
    """An addition question and its answer."""

    answer: int


class MathTask(vf.Task[MathData]):
    """One answer, scored by the XML/think rubric."""

    @property
    def key(self) -> str:
        """The durable question id (verifiers' advice when ``idx`` is run-local)."""
        return self.data.id or self.hash

    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        """Refuse a second model turn: the task is answered once."""
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the parsed answer is the sum."""
        return float(parse_answer(trace.last_reply) == str(self.data.answer))

    @vf.reward(weight=0.2)
    async def format(self, trace: vf.Trace) -> float:
        """1.0 for a think block then an answer tag."""
        return float(well_formed(trace.last_reply))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        """Characters in the reply (recorded, not rewarded)."""
        return float(len(trace.last_reply))


class MathConfig(vf.TasksetConfig):
    """Which questions: ``num_questions`` from number ``offset`` on."""

    num_questions: int = 40
    offset: int = 0


class MathTaskset(vf.Taskset[MathTask, MathConfig]):
    """``What is a + b?`` for a, b from a fixed pattern."""

    def load(self) -> list[MathTask]:
        """The questions, in a fixed order."""
        tasks = []
        for i in range(self.config.offset, self.config.offset + self.config.num_questions):
            a, b = 3 + 7 * i % 50, 11 + 5 * i % 40
            tasks.append(MathTask(MathData(idx=i, id=f"add-{i}", prompt=f"What is {a} + {b}?", system_prompt=SYSTEM,
                                           answer=a + b), self.config.task))
        return tasks


def load_math(num_questions: int = 40, offset: int = 0) -> MathTaskset:
    """The arithmetic taskset (``verifiers:tests.e2e.data.vf_envs:load_math``)."""
    return MathTaskset(MathConfig(num_questions=num_questions, offset=offset))


# -- a tool task ------------------------------------------------------------------------------------
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Egypt": "Cairo",
    "Canada": "Ottawa", "Chile": "Santiago", "Ghana": "Accra", "Spain": "Madrid", "Italy": "Rome",
    "Poland": "Warsaw", "Greece": "Athens", "Cuba": "Havana", "Nepal": "Kathmandu", "Laos": "Vientiane",
    "Mali": "Bamako", "Iran": "Tehran", "Fiji": "Suva", "Oman": "Muscat",
}


class AtlasToolset(vf.Toolset[vf.ToolsetConfig]):
    """Capital lookups; ``hint`` knows the task's country from ``setup_task``."""

    TOOL_PREFIX = "atlas"

    def __init__(self, config: vf.ToolsetConfig) -> None:
        super().__init__(config)
        self.country = ""

    async def setup_task(self, task: vf.TaskData) -> None:
        """Remember the task's country (the row verifiers hands a per-task server)."""
        self.country = task.country

    @vf.tool
    def capital(self, country: str) -> str:
        """Look up the capital city of a country."""
        return CAPITALS.get(country.strip(), f"unknown country: {country}")

    @vf.tool
    async def hint(self) -> str:
        """The first letter of the capital this task asks for."""
        return CAPITALS[self.country][0]


class LookupData(vf.TaskData):
    """The country whose capital is asked for."""

    country: str


class LookupConfig(vf.TaskConfig):
    """The per-task tool server's config."""

    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class LookupTask(vf.Task[LookupData, vf.State, LookupConfig]):
    """Look the capital up with a tool, then answer it."""

    @property
    def key(self) -> str:
        """The durable task id."""
        return self.data.id or self.hash

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        """One atlas server per rollout."""
        return [AtlasToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the answer is the capital."""
        return float(parse_answer(trace.last_reply) == CAPITALS[self.data.country])

    @vf.reward(weight=0.5)
    async def looked_up(self, trace: vf.Trace) -> float:
        """1.0 when a tool result held the capital."""
        return float(any(m.content == CAPITALS[self.data.country] for m in trace.tool_messages))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        """Tool calls made."""
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class LookupTasksetConfig(vf.TasksetConfig):
    """The per-task config."""

    task: LookupConfig = LookupConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupTasksetConfig]):
    """One task per country."""

    def load(self) -> list[LookupTask]:
        """The countries, in a fixed order."""
        return [LookupTask(LookupData(idx=i, id=f"capital-{country.lower()}", country=country,
                                      prompt=f"What is the capital of {country}? Use the atlas_capital tool, then "
                                             "answer inside <answer></answer>."), self.config.task)
                for i, country in enumerate(CAPITALS)]


def load_lookup() -> LookupTaskset:
    """The tool taskset (``verifiers:tests.e2e.data.vf_envs:load_lookup``)."""
    return LookupTaskset(LookupTasksetConfig())


# -- verifiers' own scoring, for the tests' comparisons ------------------------------------------------
def verifiers_score(task: vf.Task, conversation: list[dict]) -> vf.Trace:
    """verifiers' own scoring of a rollout, built without the bridge: each assistant message of ``conversation``
    (relax-agent's messages: what the policy saw and replied) committed to a fresh ``vf.Trace`` as a model turn over
    the messages before it, as verifiers' interception records turns, then ``Task.score``; returns the trace
    (``trace.reward``: the weighted sum verifiers gives the rollout)."""
    from verifiers.v1 import graph
    from verifiers.v1.dialects.chat import parse_message

    typed = []
    for message in conversation:
        calls = []
        for call in message.get("tool_calls") or []:
            arguments = call["function"].get("arguments")
            text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
            calls.append({**call, "function": {**call["function"], "arguments": text}})
        typed.append(parse_message({**message, "tool_calls": calls} if calls else message))
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    for i, message in enumerate(typed):
        if message.role == "assistant":
            graph.prepare_turn(trace, typed[:i], None).commit(vf.Response(
                id=str(i), created=0, model="m", message=message, finish_reason="tool_calls" if message.tool_calls else "stop"))
    trace.stop("agent_completed")
    asyncio.run(task.score(trace))
    return trace


if __name__ == "__main__":  # verifiers launches a Toolset's server as `python -m <its module>`
    AtlasToolset.run()
