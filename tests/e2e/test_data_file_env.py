"""relax/DataFile-v0 in a real Docker sandbox: tasks, the three-turn reference episode, and its
rendering as a multi-turn warm-up demonstration (token-in/token-out, loss mask on replies only)."""

from __future__ import annotations

import json

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401
from relax_agent.envs.data_file import DataFileEnv, make_tasks
from relax_agent.errors import DataError
from relax_agent.sandboxes.testing import require_backend

DOCKER = {"backend": "docker", "image": "relax-agent/python:bookworm", "memory_mb": 128, "pids_limit": 32,
          "workdir_mb": 8, "ttl_s": 300}


def test_tasks_are_deterministic_disjoint_and_their_answers_right():
    train, heldout = make_tasks("train"), make_tasks("heldout")
    assert len(train) > 2000 and 200 < len(heldout) < 400
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in heldout)
    assert len({t["id"] for t in train + heldout}) == len(train) + len(heldout)
    for t in train[:200] + heldout:
        nums = [int(x) for x in t["content"].split()]
        expected = {"sum": sum(nums), "max": max(nums), "min": min(nums),
                    "count_gt": sum(1 for x in nums if x > t["k"]),
                    "sum_even": sum(x for x in nums if x % 2 == 0)}[t["kind"]]
        assert t["answer"] == expected
        assert t["file"] not in t["question"] and str(nums[0]) not in t["question"].split()
    assert {t["kind"] for t in heldout} == {"sum", "max", "min", "count_gt", "sum_even"}
    with pytest.raises(DataError, match="split='test'"):
        make_tasks("test")


def _as_action(message: dict) -> dict:
    """A demonstrated message as the driver hands it to ``step`` (arguments as a JSON string)."""
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


@pytest.mark.docker
def test_the_reference_episode_steps_a_real_sandbox_to_the_demonstrated_observations():
    require_backend("docker")
    env = gymnasium.make("relax/DataFile-v0", sandbox=DOCKER)
    try:
        for task in make_tasks("heldout")[:5]:
            obs, info = env.reset(seed=0, options={"task": task})
            assert "run_python" in json.dumps(info["tools"]) and task["question"] in obs[0]["content"]
            demo = env.unwrapped.demonstration(task)
            assert [m["role"] for m in demo] == ["assistant", "tool", "assistant", "tool", "assistant"]
            for i in (0, 2):
                got, reward, terminated, _, step_info = env.step(_as_action(demo[i]))
                assert got == [demo[i + 1]] and not terminated  # the tool output the demonstration shows
            assert demo[1]["content"] == f"['{task['file']}']" and demo[3]["content"] == str(task["answer"])
            _, reward, terminated, _, step_info = env.step(demo[4])
            assert (reward, terminated) == (1.0, True)
            assert step_info == {"correct": 1.0, "answered": 1.0, "tool_calls": 2.0}
        # without reading the file the episode cannot be answered: a guess is scored 0
        task = make_tasks("heldout")[0]
        env.reset(seed=0, options={"task": task})
        assert env.step({"role": "assistant", "content": f"Answer: {task['answer'] + 1}"})[1] == 0.0
        # a new episode's sandbox holds only its own task's file
        env.reset(seed=0, options={"task": make_tasks("heldout")[1]})
        got = env.step(_as_action(demo[0]))[0]
        assert got[0]["content"] == f"['{make_tasks('heldout')[1]['file']}']"
    finally:
        env.close()


def test_a_task_without_its_file_is_refused_naming_the_keys():
    env = DataFileEnv(sandbox={"backend": "fake"})
    with pytest.raises(DataError, match="lacks.*content.*file"):
        env.reset(options={"task": {"id": "x", "question": "q", "answer": 1}})
    env.close()


@pytest.mark.slow
def test_a_multi_turn_demonstration_is_laid_out_as_an_episode(tiny_model_dir):
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.demonstrations import demonstration_fields
    from relax_agent.rollout.parsers import build_parser, format_message

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    renderer, parser = ChatRenderer(tok, tool_example=False), build_parser("hermes_strict")
    make = lambda: DataFileEnv(sandbox={"backend": "fake"})  # noqa: E731  (rendering needs no real tool run)
    tasks = make_tasks("train")[:3]
    demos = demonstration_fields(make, renderer, parser, tasks, seed=0)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    env = make()
    for task, ids, mask in zip(tasks, demos["token_ids"], demos["loss_mask"], strict=True):
        obs, info = env.reset(seed=0, options={"task": task})
        expected, expected_mask = list(renderer.render_prompt(obs, info["tools"]).token_ids), None
        expected_mask = [0] * len(expected)
        demo = env.unwrapped.demonstration(task)
        for message in demo:
            if message["role"] == "assistant":
                part = tok(format_message(parser, message), add_special_tokens=False)["input_ids"] + [stop]
                flag = 1
            else:
                part, flag = renderer.observation_delta([message], closed=True), 0
            expected += part
            expected_mask += [flag] * len(part)
        assert list(ids) == expected and list(mask) == expected_mask
        # the replies under the mask read back as the demonstrated calls and answer
        spans, cur = [], []
        for t, m in zip(ids, mask, strict=True):
            if m:
                cur.append(int(t))
            elif cur:
                spans.append(cur)
                cur = []
        spans.append(cur)
        assert len(spans) == 3
        calls = [parser.parse(tok.decode(s, skip_special_tokens=True)).message() for s in spans]
        args = calls[1]["tool_calls"][0]["function"]["arguments"]
        assert (json.loads(args) if isinstance(args, str) else args)["code"].startswith(
            f"nums = [int(x) for x in open('{task['file']}')")
        assert calls[2]["content"].strip() == f"Answer: {task['answer']}"
    env.close()
