"""`relax-agent train examples/agents/openai_sdk_agent.yaml` runs two steps with the tiny model: every
episode is the example agent (a subprocess using the openai SDK, on chat completions or Responses, or
the anthropic SDK) calling the policy's endpoint; `relax-agent replay` then judges step 1's
agent-driven episodes without divergence."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tmp_path(open_dir):
    """pytest's own tmp_path is reachable by root only: the agents here run as an unprivileged uid."""
    return open_dir


@pytest.mark.parametrize("agent", ["openai_sdk_agent.py", "responses_agent.py", "anthropic_agent.py"])
def test_two_training_steps_through_the_example_agent(tiny_model_dir, tmp_path, agent):
    """The same run whichever API the agent speaks (chat completions, Responses, Anthropic Messages)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/agents/openai_sdk_agent.yaml", "--quiet",
           f"model.path={tiny_model_dir}", f"run.output_dir={out}", "trainer.steps=2", "rollout.tasks_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
           "rollout.agent.env.AGENT_MAX_TURNS='2'", "eval.at_start=false", "eval.num_tasks=2", "trainer.micro_batch_size=4",
           "checkpoint.every_steps=0", "run.num_threads=1", "logging.tensorboard=false", "logging.plot=false",
           f'rollout.agent.command=["{{python}}", "examples/agents/{agent}"]']
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
    samples = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    assert all(s["error"] is None for s in samples), [s["error"] for s in samples]
    assert all(s["metrics"]["agent/requests"] >= 1 for s in samples)
    assert all(s["response"] for s in samples)
    # relax-agent replay judges the agent-driven episodes of step 1 (version 0: the base model's log-probs)
    done = subprocess.run([sys.executable, "-m", "relax_agent.cli", "replay", "examples/agents/openai_sdk_agent.yaml",
                           *cmd[6:], "--step", "1"], cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    n = int(last.split(" of ")[1].split()[0])
    assert last == f"step 1: {n} of {n} episodes replay without divergence" and n >= 4, done.stdout
    assert "skipped" not in done.stdout, done.stdout


_SIDE_CALL_AGENT = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
reply = client.chat.completions.create(model="policy", messages=task["messages"])
client.chat.completions.create(model="policy", messages=[  # a side call after the answer
    {"role": "user", "content": "Give this a short title: " + (reply.choices[0].message.content or "")}])
index = int(task["sample_id"].rsplit("/", 1)[-1])  # the episode's place in its group: rewards 0 and 1
json.dump({"reward": float(index % 2)}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""


def test_train_branches_trains_each_side_call_with_its_episode(tiny_model_dir, tmp_path):
    """``rollout.agent.train_branches=true`` with an agent that makes one side call after its answer
    (the agent scores itself 0 or 1, so every episode has a non-zero advantage): every step trains
    its 4 chains and their 4 side segments, and the dump marks each segment trained."""
    agent = tmp_path / "side_call_agent.py"
    agent.write_text(_SIDE_CALL_AGENT)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/agents/openai_sdk_agent.yaml", "--quiet",
           f"model.path={tiny_model_dir}", f"run.output_dir={out}", "trainer.steps=2", "rollout.tasks_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_total_tokens=1024",
           "rollout.agent.reward=agent", "rollout.agent.train_branches=true", "eval.at_start=false",
           "eval.at_end=false", "trainer.micro_batch_size=8", "checkpoint.every_steps=0", "run.num_threads=1",
           "logging.tensorboard=false", "logging.plot=false", f'rollout.agent.command=["{{python}}", "{agent}"]']
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "rollout/reward" in r]
    assert [(r["train/samples"], r["train/side_branches"]) for r in steps] == [(4.0, 4.0), (4.0, 4.0)]
    for step in (1, 2):
        rows = [json.loads(x) for x in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        side = [r for r in rows if r.get("side_branch_of")]
        assert len(side) == 4 and all(r["trained"] for r in rows), rows
        assert {r["side_branch_of"] for r in side} == {r["sample_id"] for r in rows if not r.get("side_branch_of")}


_TOOLLESS_FINAL_AGENT = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
messages = list(task["messages"])
reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"]).choices[0].message
messages.append(reply.model_dump(exclude_none=True))
for call in reply.tool_calls or []:
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "0"})
messages.append({"role": "user", "content": "Now give the final answer."})
client.chat.completions.create(model="policy", messages=messages)  # the fallback: no tools this time
index = int(task["sample_id"].rsplit("/", 1)[-1])  # the episode's place in its group: rewards 0 and 1
json.dump({"reward": float(index % 2)}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""


def test_a_tool_less_final_request_trains_the_reply_it_built_on_as_a_context(tiny_model_dir, tmp_path):
    """An agent whose last request drops ``tools`` continues its episode in a new context: each step
    trains, beside its 4 episodes, one context row per episode whose first reply it built on (the
    episode's ``agent/contexts`` - 1), and no side branch."""
    agent = tmp_path / "toolless_final_agent.py"
    agent.write_text(_TOOLLESS_FINAL_AGENT)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/agents/openai_sdk_agent.yaml", "--quiet",
           f"model.path={tiny_model_dir}", f"run.output_dir={out}", "trainer.steps=2", "rollout.tasks_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_total_tokens=1024",
           "rollout.agent.reward=agent", "eval.at_start=false", "eval.at_end=false", "trainer.micro_batch_size=8",
           "checkpoint.every_steps=0", "run.num_threads=1", "logging.tensorboard=false", "logging.plot=false",
           f'rollout.agent.command=["{{python}}", "{agent}"]']
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "rollout/reward" in r]
    assert len(steps) == 2
    for step, metrics in enumerate(steps, start=1):
        rows = [json.loads(x) for x in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        episodes = [r for r in rows if not r.get("context_of") and not r.get("side_branch_of")]
        assert len(episodes) == 4 and all(r["error"] is None for r in episodes), episodes
        contexts = sum(r["metrics"]["agent/contexts"] - 1 for r in episodes)
        assert contexts >= 1 and (metrics["train/samples"], metrics["train/context_segments"]) == (4.0, contexts)
        assert metrics["train/side_branches"] == 0.0
    # every context of every episode replays on its own (log-probs of version 0 included)
    done = subprocess.run([sys.executable, "-m", "relax_agent.cli", "replay", "examples/agents/openai_sdk_agent.yaml",
                           *cmd[6:], "--step", "1"], cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    n = int(last.split(" of ")[1].split()[0])
    assert last == f"step 1: {n} of {n} episodes replay without divergence" and n >= 5, done.stdout
