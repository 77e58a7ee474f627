"""BFCL multi-turn environments: stateful APIs, several user turns, BFCL's turn-level check.

    env = gymnasium.make("relax/BFCL-multi-turn-base-v0", max_steps_per_turn=3)
    messages, info = env.reset(options={"task": task})     # first user turn; info["tools"]
    obs, reward, terminated, truncated, info = env.step(
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c0", "type": "function",
                         "function": {"name": "cd", "arguments": {"folder": "document"}}}]})
    # obs: [{"role": "tool", "tool_call_id": "c0", "name": "cd", "content": '{"current_working_directory": "document"}'}]
    obs, reward, ... = env.step({"role": "assistant", "content": "Done."})   # ends turn 0
    # obs: the next user turn; reward: 1/judged turns if turn 0 was right

An episode plays the task's user turns in order. Inside a turn, each assistant message with
tool calls runs them against the episode's own API instances (:class:`ApiSession`, a fresh set
per ``reset``) and returns one ``tool`` message per call. The turn ends when the model answers
without a tool call, or with a message whose calls do not all decode (a block the parser could
not read, or arguments that are not a JSON object): as in BFCL, such a message is dropped whole,
none of its calls run, and it ends the turn like an answer without calls; or after its
``max_steps_per_turn + 1``-th message with calls (BFCL's ``MAXIMUM_STEP_LIMIT`` force-quit; the
task is then failed, and the episode goes on to the next turn so later turns still earn credit).
The ended turn is judged (:mod:`relax_agent.envs.bfcl.multi_turn_checker`) and the next user
turn is the observation; after the last turn the episode terminates.

In the miss-func variant a turn without a user message hands out withheld function docs: the
observation is a user message holding those docs (one JSON schema per line, as in the system
prompt) followed by BFCL's prompt "I have updated some more functions you can choose from. What
about now?" (BFCL's prompting-model format; tools already rendered into the prompt cannot change).
As in BFCL, every method of the task's classes can be called, withheld ones included (the data
relies on it: ``multi_turn_miss_func_49`` calls ``tail`` a turn before its doc arrives).

Reward: each judged turn that is correct adds ``1 / judged turns`` at the step that ends it, so
an episode's rewards sum to the fraction of judged turns correct, even when the rollout
truncates it. ``info`` of every step carries the running numbers (``turn_accuracy``,
``correct`` / ``task_correct`` = BFCL's whole-task 0/1, ``well_formed``, ``num_calls``).

``bfcl_compat=True`` shares omitted mutable defaults between the episode's and the ground
truth's API instances, as BFCL does (see :mod:`relax_agent.envs.bfcl.multi_turn_checker`).

Episode length in model turns (``env.max_turns`` in the config counts LLM calls): at most
``turns x (max_steps_per_turn + 1)``; BFCL tasks have up to 7 turns (8 in the miss variants).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_env_args, split_tasks
from relax_agent.envs.bfcl.decode import tool_call_entries
from relax_agent.envs.bfcl.multi_turn_api import ApiSession
from relax_agent.envs.bfcl.multi_turn_checker import TurnJudge, decodable_step, session_for
from relax_agent.envs.bfcl.multi_turn_data import API_CLASSES, CATEGORIES, compact_doc, load_tasks, task_docs
from relax_agent.envs.bfcl.schema import to_openai_tool
from relax_agent.envs.tool_env import truncate
from relax_agent.errors import ConfigError, EnvError

ADDED_FUNCTIONS_PROMPT = "{functions}\nI have updated some more functions you can choose from. What about now?"
"""BFCL's ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING`` (``constants/default_prompts.py``)."""
BFCL_MAX_STEPS_PER_TURN = 20
"""BFCL's ``MAXIMUM_STEP_LIMIT``."""


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(id, name, arguments)`` of each tool call of an assistant message (OpenAI or flat entries).

    ``arguments`` may be a dict or a JSON string; one that does not decode is kept as is (its
    call then fails with an error result). A call without an id gets ``call_<index>``.
    """
    return [(call_id or f"call_{i}", name, arguments)
            for i, (call_id, name, arguments) in enumerate(tool_call_entries(message))]


class BFCLMultiTurnEnv(TextEnv):
    """A BFCL v4 multi-turn category as a gymnasium environment.

    Args:
        category: "multi_turn_base", "multi_turn_miss_func" or "multi_turn_miss_param".
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of tasks held out, by SHA-1 of the task id (0.25: 57 of the
            200 base tasks, so a 50-task held-out evaluation fits).
        max_steps_per_turn: assistant messages with tool calls a turn may have before the next
            one force-ends it (BFCL: 20).
        max_observation_chars: longest tool result shown to the model (the checker always
            compares full results).
        classes: keep only tasks whose API classes are all in this list (e.g. ``["TradingBot"]``);
            None keeps every task.
        compact_docs: drop the class preamble BFCL repeats in every function description
            (:func:`compact_doc`; ~25% fewer prompt tokens, for small context windows).
        bfcl_compat: reproduce BFCL's verdicts where our checker deliberately differs (shared
            mutable defaults).

    Raises:
        ConfigError: an argument outside the values above.
    """

    reward_description = (
        "Fraction of the task's judged turns (those with ground-truth calls) that are correct by "
        "BFCL's multi-turn check: after the turn, the episode's API instances have the same state "
        "as after the ground-truth calls, and the ground-truth results appear among the model's "
        "results so far. Paid turn by turn (1/judged turns each). info['correct'] (also "
        "'task_correct'): 1.0 when every judged turn is correct and no turn hit the step limit."
    )
    _turn_results: list[str]  # results of the current turn's calls; set by _reset_task

    def __init__(self, category: str = "multi_turn_base", split: str = "train", heldout_fraction: float = 0.25,
                 max_steps_per_turn: int = BFCL_MAX_STEPS_PER_TURN, max_observation_chars: int = 4000,
                 classes: list[str] | None = None, compact_docs: bool = False, bfcl_compat: bool = False) -> None:
        super().__init__()
        check_env_args(category, CATEGORIES, split, heldout_fraction)
        if max_steps_per_turn < 0 or max_observation_chars < 100:
            raise ConfigError(f"need max_steps_per_turn >= 0 and max_observation_chars >= 100; "
                              f"got {max_steps_per_turn}, {max_observation_chars}")
        self.category = category
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.max_steps_per_turn = max_steps_per_turn
        self.max_observation_chars = max_observation_chars
        unknown = sorted(set(classes or ()) - set(API_CLASSES))
        if unknown:
            raise ConfigError(f"classes={classes!r}: unknown {unknown}; expected names from {sorted(API_CLASSES)}")
        self.classes = None if classes is None else frozenset(classes)
        self.compact_docs = compact_docs
        self.bfcl_compat = bfcl_compat
        self._session: ApiSession | None = None
        self._judge: TurnJudge | None = None

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts of ``split`` (see :mod:`relax_agent.envs.bfcl.multi_turn_data`).

        Raises:
            DataError: unknown split, or the bfcl-eval wheel is missing.
        """
        tasks = split_tasks(load_tasks(self.category), split, self.heldout_fraction)
        if self.classes is not None:
            tasks = [t for t in tasks if self.classes.issuperset(t["involved_classes"])]
        return tasks

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        offered, self._added = task_docs(task)
        if self.compact_docs:
            offered = [compact_doc(d) for d in offered]
            self._added = {turn: [compact_doc(d) for d in docs] for turn, docs in self._added.items()}
        pool: dict[tuple[str, str, str], Any] | None = {} if self.bfcl_compat else None
        self._session = session_for(task, pool)
        self._judge = TurnJudge(task, pool)
        self._turn, self._steps, self._turn_results, self._turn_calls = 0, 0, [], 0
        self._judged = sum(1 for gt in task["ground_truth"] if gt)
        self._turns_correct, self._forced, self._calls, self._well_formed = 0, False, 0, 0
        self._done = False
        info = {"tools": [to_openai_tool(d) for d in offered], "task_id": task["id"], "num_turns": len(task["turns"])}
        return self._turn_messages(0), info

    def _turn_messages(self, turn: int) -> list[dict[str, Any]]:
        if turn in self._added:
            schemas = "\n".join(json.dumps(to_openai_tool(d)["function"], ensure_ascii=False) for d in self._added[turn])
            return [{"role": "user", "content": ADDED_FUNCTIONS_PROMPT.format(functions=schemas)}]
        return copy.deepcopy(self.task["turns"][turn])

    def step(self, action: dict[str, Any]):
        """Run the message's tool calls, or end the turn; see the module docstring.

        Returns:
            ``(observation, reward, terminated, False, info)``: tool messages (and, when the
            turn ends, the next turn's user message); reward ``1/judged turns`` when this step
            ends a correct judged turn, else 0.0; info with the running metrics, plus ``reason``
            (the last verdict) and ``tools_added`` (schemas handed out with this observation).

        Raises:
            EnvError: ``step`` before ``reset`` or after the episode ended, or an action that is
                not an assistant message dict.
        """
        if self.task is None or self._session is None or self._done:
            raise EnvError("BFCLMultiTurnEnv.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict) or action.get("role", "assistant") != "assistant":
            got = type(action).__name__ if not isinstance(action, dict) else f"role {action.get('role')!r}"
            raise EnvError(f"action must be an assistant message dict, got {got}")
        if not isinstance(action.get("tool_calls") or [], list):
            raise EnvError(f"action['tool_calls'] must be a list, got {type(action['tool_calls']).__name__}")
        parse_errors = action.get("parse_errors") or []
        self._calls += len(parse_errors)
        calls = calls_of(action)
        if parse_errors or not decodable_step([{"name": n, "arguments": a} for _, n, a in calls]):
            self._calls += len(calls)  # BFCL drops the undecodable message whole: nothing runs
            return self._end_turn([])
        observation = [self._run(*call) for call in calls]
        if calls:
            self._steps += 1
            if self._steps <= self.max_steps_per_turn:
                return observation, 0.0, False, False, self._info()
            self._forced = True
        return self._end_turn(observation)

    def _run(self, call_id: str, name: Any, arguments: Any) -> dict[str, Any]:
        assert self._session is not None
        self._calls += 1
        if self._session.has(name) and isinstance(arguments, dict) and _fits(self._session, name, arguments):
            self._well_formed += 1
        result = self._session.call(name, arguments) if isinstance(name, str) else "Error during execution: no function name"
        self._turn_results.append(result)
        self._turn_calls += 1
        content = truncate(result, self.max_observation_chars)
        return {"role": "tool", "tool_call_id": call_id, "name": name if isinstance(name, str) else "", "content": content}

    def _end_turn(self, observation: list[dict[str, Any]]):
        assert self._judge is not None and self._session is not None
        verdict = self._judge.judge(self._session, self._turn_results, self._turn_calls)
        reward = 0.0
        if verdict is not None and verdict.correct:
            self._turns_correct += 1
            reward = 1.0 / self._judged
        self._turn += 1
        self._steps, self._turn_results, self._turn_calls = 0, [], 0
        info = self._info()
        info["reason"] = verdict.reason if verdict is not None else "turn not judged (no ground-truth calls)"
        if self._turn == len(self.task["turns"]):
            self._done = True
            return observation, reward, True, False, info
        if self._turn in self._added:
            info["tools_added"] = [to_openai_tool(d) for d in self._added[self._turn]]
        return observation + self._turn_messages(self._turn), reward, False, False, info

    def _info(self) -> dict[str, Any]:
        finished = self._turn == len(self.task["turns"])
        correct = float(finished and not self._forced and self._turns_correct == self._judged)
        return {
            "turn": self._turn,
            "turn_accuracy": self._turns_correct / self._judged,
            "correct": correct,
            "task_correct": correct,
            "forced_turn_end": float(self._forced),
            "num_calls": self._calls,
            "well_formed": self._well_formed / self._calls if self._calls else 0.0,
        }

    def close(self) -> None:
        """Drop the episode's API instances."""
        self._session = self._judge = None
        super().close()


def _fits(session: ApiSession, name: str, arguments: dict[str, Any]) -> bool:
    try:
        session.signature(name).bind(**arguments)
    except TypeError:
        return False
    return True
