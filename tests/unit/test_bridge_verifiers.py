"""The verifiers bridge (``relax/Verifiers-v0``, ``env.id: "verifiers:..."``) on real verifiers 0.4 environments
(tests/e2e/data/vf_envs.py, vf_dialogue.py): the reward is verifiers' own scoring of the rollout, tool calls parsed
by relax-agent run the verifiers tools, an ``Env.run`` answers each reply, limits stop and score as verifiers does,
what the bridge cannot play is refused with a ConfigError, and a missing package names the extra."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

import relax_agent.envs as envs
from relax_agent.errors import ConfigError, DataError, EnvError
from tests.e2e.data.vf_envs import verifiers_score

DATA = Path(__file__).resolve().parents[1] / "e2e" / "data"
MATH = "verifiers:tests.e2e.data.vf_envs:load_math"
LOOKUP = "verifiers:tests.e2e.data.vf_envs:load_lookup"


def play(env, task: dict, replies: list[dict]) -> tuple[list[dict], list[tuple]]:
    """Reset on ``task`` and step through ``replies`` until the episode ends: (the conversation, the steps)."""
    obs, _ = env.reset(options={"task": task})
    conversation, steps = list(obs), []
    for reply in replies:
        step = env.step(reply)
        steps.append(step)
        conversation += [reply, *step[0]]
        if step[2] or step[3]:
            break
    return conversation, steps


def vf_task(env, task: dict):
    return env.unwrapped._tasks[task["id"]]


@pytest.mark.parametrize(("reply", "expected", "scores"), [
    ("<think>{a} plus {b}</think> <answer>{s}</answer>", 1.2, {"correct": 1.0, "format": 1.0}),
    ("It is \\boxed{{{s}}}.", 1.0, {"correct": 1.0, "format": 0.0}),
    ("<think>hm</think><answer>{w}</answer>", 0.2, {"correct": 0.0, "format": 1.0}),
    ("no idea", 0.0, {"correct": 0.0, "format": 0.0}),
])
def test_single_turn_reward_is_verifiers_own_scoring(reply, expected, scores):
    env = envs.make(MATH)
    try:
        task = env.unwrapped.tasks("train")[3]
        vtask = vf_task(env, task)
        a, b = (int(x) for x in vtask.data.prompt.removeprefix("What is ").removesuffix("?").split(" + "))
        text = reply.format(a=a, b=b, s=vtask.data.answer, w=vtask.data.answer + 1)
        obs, info = env.reset(options={"task": task})
        assert obs == [{"role": "system", "content": vtask.data.system_prompt}, {"role": "user", "content": vtask.data.prompt}]
        assert info["tools"] == [] and info["task_id"] == task["id"]
        conversation, steps = play(env, task, [{"role": "assistant", "content": text, "tool_calls": []}])
        (new, reward, terminated, truncated, step_info), = steps
        assert (new, terminated, truncated) == ([], True, False)
        assert reward == pytest.approx(expected)
        assert reward == pytest.approx(verifiers_score(vtask, conversation).reward)
        assert {k: step_info[f"vf_reward_{k}"] for k in scores} == scores
        assert step_info["vf_metric_reply_chars"] == len(text.strip()) and step_info["reason"] == "agent_completed"
    finally:
        env.close()


def test_a_tool_call_parsed_by_relax_agent_runs_the_verifiers_tool():
    from relax_agent.rollout.tool_parsers import Qwen3Parser
    from tests.e2e.data.vf_envs import CAPITALS

    env = envs.make(LOOKUP)
    try:
        task = env.unwrapped.tasks("train")[0]
        vtask = vf_task(env, task)
        country, capital = vtask.data.country, CAPITALS[vtask.data.country]
        obs, info = env.reset(options={"task": task})
        assert obs == [{"role": "user", "content": vtask.data.prompt}]
        assert [t["function"]["name"] for t in info["tools"]] == ["atlas_capital", "atlas_hint"]
        assert info["tools"][0]["function"]["parameters"]["required"] == ["country"]
        parser = Qwen3Parser()
        call = parser.parse(f'<think>look it up</think>\n<tool_call>\n{{"name": "atlas_capital", "arguments": '
                            f'{{"country": "{country}"}}}}\n</tool_call>\n<tool_call>\n{{"name": "atlas_hint", '
                            '"arguments": {}}\n</tool_call>').message()
        answer = parser.parse(f"<answer>{capital}</answer>").message()
        conversation, steps = play(env, task, [call, answer])
        ids = [c["id"] for c in call["tool_calls"]]
        assert steps[0][:4] == ([{"role": "tool", "tool_call_id": ids[0], "content": capital, "name": "atlas_capital"},
                                 {"role": "tool", "tool_call_id": ids[1], "content": capital[0], "name": "atlas_hint"}],
                                0.0, False, False)
        new, reward, terminated, _, info = steps[1]
        assert (new, terminated, reward) == ([], True, 1.5)
        assert reward == verifiers_score(vtask, conversation).reward
        assert (info["vf_reward_correct"], info["vf_reward_looked_up"], info["vf_metric_tool_calls"]) == (1.0, 1.0, 2.0)
    finally:
        env.close()


def test_bad_tool_calls_get_verifiers_own_error_messages_and_the_reward_counts_them():
    env = envs.make(LOOKUP)
    try:
        task = env.unwrapped.tasks("train")[1]
        vtask = vf_task(env, task)
        calls = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "nope", "arguments": {}}},
            {"id": "b", "type": "function", "function": {"name": "atlas_capital", "arguments": {}}},
            {"id": "c", "type": "function", "function": {"name": "atlas_capital", "arguments": "[1]"}}]}
        conversation, steps = play(env, task, [calls, {"role": "assistant", "content": "<answer>Nowhere</answer>"}])
        contents = [m["content"] for m in steps[0][0]]
        assert contents[0] == "error: unknown tool 'nope'"
        assert contents[1].startswith("Error executing tool capital: 1 validation error") and "country" in contents[1]
        assert contents[2] == "error: tool arguments must be a JSON object, got list; resend as an object"
        assert steps[1][1] == 0.0 == verifiers_score(vtask, conversation).reward
    finally:
        env.close()


def test_an_env_run_answers_each_reply_and_its_own_rewards_count(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))  # vf_dialogue loads by name, through verifiers' own loader
    env = envs.make("verifiers:vf_dialogue", env_args={"max_guesses": 3})
    try:
        assert type(env.unwrapped.vf_env).__name__ == "GuessEnv"
        task = env.unwrapped.tasks("train")[0]
        vtask = vf_task(env, task)
        secret = vtask.data.secret
        low = {"role": "assistant", "content": f"<guess>{secret - 1}</guess>"}
        conversation, steps = play(env, task, [low, {"role": "assistant", "content": f"<guess>{secret}</guess>"}])
        assert steps[0][:3] == ([{"role": "user", "content": "Higher. Guess again."}], 0.0, False)
        new, reward, terminated, _, info = steps[1]
        assert (new, terminated, info["reason"]) == ([], True, "user_closed")
        assert (info["vf_reward_solved"], info["vf_reward_quick"], info["vf_reward_game"]) == (1.0, 0.5, 1.0)
        assert reward == 1.0 + 0.5 * 0.5 + 0.25 * 1.0
        assert reward == verifiers_score(vtask, conversation).reward + 0.25  # the task's rewards + the env's "game"
        _, steps = play(env, task, [low] * 5)
        assert len(steps) == 3 and steps[-1][1:3] == (0.0, True)  # max_guesses replies, then the env ends it
    finally:
        env.close()


def test_max_turns_stops_the_run_and_verifiers_scores_what_it_has():
    env = envs.make(LOOKUP, max_turns=1)
    try:
        task = env.unwrapped.tasks("train")[2]
        vtask = vf_task(env, task)
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "atlas_capital", "arguments": {"country": vtask.data.country}}}]}
        conversation, steps = play(env, task, [call])
        new, reward, terminated, _, info = steps[0]
        assert (new, terminated, info["reason"]) == ([], True, "max_turns")
        # verifiers refuses the second model call before recording its request, so the tool result never reaches
        # the trace: looked_up is 0 too, exactly as verifiers scores a run cut at max_turns.
        assert (info["vf_reward_correct"], info["vf_reward_looked_up"], reward) == (0.0, 0.0, 0.0)
        assert reward == verifiers_score(vtask, conversation).reward
    finally:
        env.close()


def test_splits_are_disjoint_and_heldout_args_load_a_second_taskset():
    env, again = envs.make(MATH), envs.make(MATH)
    try:
        train, heldout = env.unwrapped.tasks("train"), env.unwrapped.tasks("heldout")
        assert len(train) + len(heldout) == 40 and heldout  # a hash split of verifiers' task keys
        assert not {t["id"] for t in train} & {t["id"] for t in heldout}
        assert train == again.unwrapped.tasks("train")
        with pytest.raises(DataError, match="unknown split 'test'"):
            env.unwrapped.tasks("test")
    finally:
        env.close()
        again.close()
    env = envs.make(MATH, env_args={"num_questions": 30}, heldout_args={"offset": 25, "num_questions": 10})
    try:
        train, heldout = env.unwrapped.tasks("train"), env.unwrapped.tasks("heldout")
        assert [t["key"] for t in heldout] == [f"add-{i}" for i in range(25, 35)]
        assert [t["key"] for t in train] == [f"add-{i}" for i in range(25)]  # the 5 it shares with heldout dropped
        obs, _ = env.reset(options={"task": heldout[-1]})
        assert obs[-1]["content"] == vf_task(env, heldout[-1]).data.prompt
    finally:
        env.close()


def test_step_outside_an_episode_is_an_env_error():
    env = envs.make(MATH)
    try:
        with pytest.raises(EnvError, match="reset"):
            env.unwrapped.step({"role": "assistant", "content": "x"})
        env.reset(seed=0)
        env.step({"role": "assistant", "content": "x"})
        with pytest.raises(EnvError, match="reset"):
            env.unwrapped.step({"role": "assistant", "content": "x"})
    finally:
        env.close()


def test_async_api_plays_on_the_env_loop_without_blocking_the_caller():
    from tests.e2e.data.vf_envs import CAPITALS

    env = envs.make(LOOKUP)
    inner = env.unwrapped
    task = inner.tasks("train")[0]
    country = vf_task(env, task).data.country

    async def episode() -> tuple:
        ticks = []

        async def ticker() -> None:
            while True:
                ticks.append(1)
                await asyncio.sleep(0)

        running = asyncio.ensure_future(ticker())
        obs, info = await inner.areset(options={"task": task})
        tools = await inner.astep({"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "atlas_capital", "arguments": {"country": country}}}]})
        end = await inner.astep({"role": "assistant", "content": f"<answer>{CAPITALS[country]}</answer>"})
        running.cancel()
        return obs, tools, end, ticks

    try:
        obs, tools, end, ticks = asyncio.run(episode())
        assert tools[0][0]["content"] == CAPITALS[country] and end[1:3] == (1.5, True)
        assert ticks  # the caller's loop kept running while the episode ran on the env's own
    finally:
        env.close()


def test_close_mid_episode_stops_the_env_thread():
    env = envs.make(LOOKUP)
    before = {t.name for t in threading.enumerate()}
    env.reset(seed=0)
    assert "verifiers-bridge" in {t.name for t in threading.enumerate()} - before
    env.close()
    env.close()
    assert "verifiers-bridge" not in {t.name for t in threading.enumerate()} - before


def test_unsupported_verifiers_envs_are_config_errors():
    import verifiers.v1 as vf

    from relax_agent.envs.bridges.verifiers import check_supported
    from tests.e2e.data import vf_envs

    class Boxed(vf_envs.MathTask):
        @vf.reward
        async def in_box(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
            return 1.0

    class Counter(vf.State):
        n: int = 0

    class Stateful(vf.Toolset[vf.ToolsetConfig, Counter]):
        @vf.tool
        async def bump(self) -> int:
            """Count."""
            return 1

    class WithStatefulTools(vf_envs.MathTask):
        @classmethod
        def toolsets(cls, config):
            return [Stateful(vf.ToolsetConfig())]

    taskset = vf_envs.load_math(2)
    data = vf_envs.MathData(idx=0, prompt="1 + 1?", answer=2)
    with pytest.raises(ConfigError, match=r"\['in_box'\], which need a runtime box"):
        check_supported(None, taskset, [Boxed(data)])
    with pytest.raises(ConfigError, match="stateful toolsets"):
        check_supported(None, taskset, [WithStatefulTools(data)])
    with pytest.raises(ConfigError, match="needs a container"):
        check_supported(None, taskset, [vf_envs.MathTask(data.model_copy(update={"image": "python:3.11"}))])
    with pytest.raises(ConfigError, match="returned str; expected a verifiers.v1.Env or a verifiers.v1.Taskset"):
        envs.make("verifiers:json:dumps", env_args={"obj": 1})
    with pytest.raises(ConfigError, match="verifiers environment 'no_such_vf_env'.*ModuleNotFoundError"):
        envs.make("verifiers:no_such_vf_env")
    with pytest.raises(ConfigError, match="num_tasks=0"):
        envs.make(MATH, num_tasks=0)


def test_a_missing_verifiers_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError, match=r"pip install 'relax-agent\[verifiers\]'"):
        envs.make(MATH)


def test_available_lists_what_verifiers_loader_finds():
    from relax_agent.envs.bridges import offered

    names = offered("verifiers")
    assert {"harbor", "nemo_gym", "openenv", "textarena"} <= set(names) and names == sorted(names)
