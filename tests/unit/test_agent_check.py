"""``relax-agent agent check``: real agent programs against the scripted policy on 127.0.0.1 — the
example agent passes every row, a broken one fails exactly the rows it breaks, with the fix."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax_agent.cli import app

REPO = Path(__file__).resolve().parents[2]

BROKEN = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI()
messages = list(task["messages"])
for _ in range(2):  # never offers the tools, re-renders its history, fixes the seed
    reply = client.chat.completions.create(model="policy", messages=messages, seed=1234).choices[0].message
    messages.append({"role": "assistant", "content": (reply.content or "").upper()})
    messages.append({"role": "user", "content": "Are you sure?"})
"""


@pytest.fixture
def tmp_path(open_dir):
    """pytest's own tmp_path is reachable by root only: the agents here run as an unprivileged uid."""
    return open_dir


def _rows(output: str) -> dict[str, str]:
    return {line[6:].split("  ")[0].strip(): line[:5].strip() for line in output.splitlines()
            if line[:5].strip() in ("PASS", "WARN", "FAIL")}


@pytest.mark.parametrize("agent", ["openai_sdk_agent.py", "responses_agent.py", "anthropic_agent.py"])
def test_the_example_agent_passes_every_check(tiny_model_dir, agent):
    """The same checks whichever API the agent speaks (chat completions, Responses, Anthropic Messages)."""
    res = CliRunner().invoke(app, ["agent", "check", str(REPO / "examples/agents" / agent),
                                   "--model", str(tiny_model_dir), "--tasks", "2"])
    assert res.exit_code == 0, res.output
    rows = _rows(res.output)
    assert len(rows) == 11 and set(rows.values()) == {"PASS"}, res.output
    assert "4 requests over 2 tasks" in res.output  # a tool call, then the answer, per task
    assert "11/11 checks passed" in res.output


def test_a_broken_agent_fails_the_rows_it_breaks(tiny_model_dir, tmp_path):
    program = tmp_path / "broken_agent.py"
    program.write_text(textwrap.dedent(BROKEN))
    res = CliRunner().invoke(app, ["agent", "check", str(program), "--model", str(tiny_model_dir), "--tasks", "1"])
    assert res.exit_code == 1, res.output
    rows = _rows(res.output)
    assert {k for k, v in rows.items() if v == "FAIL"} == {"tools sent", "tool calls answered", "history verbatim",
                                                          "no fixed seed"}, res.output
    assert rows["runs"] == rows["requests"] == "PASS" and rows["nothing dropped"] == "WARN"
    assert "seed=1234" in res.output and "fix: drop seed" in res.output
    assert "model_dump(exclude_none=True)" in res.output


def test_a_crashing_agent_fails_runs_with_its_stderr(tiny_model_dir, tmp_path):
    program = tmp_path / "crash.py"
    program.write_text("import sys\nsys.stderr.write('KeyError: OPENAI_BASE_URL')\nsys.exit(4)\n")
    res = CliRunner().invoke(app, ["agent", "check", str(program), "--model", str(tiny_model_dir), "--tasks", "1"])
    rows = _rows(res.output)
    assert res.exit_code == 1 and rows["runs"] == "FAIL" and rows["requests"] == "FAIL", res.output
    assert "agent exited with code 4" in res.output and "KeyError: OPENAI_BASE_URL" in res.output


def test_the_example_config_passes_and_its_env_scores_the_answer(tiny_model_dir):
    res = CliRunner().invoke(app, ["agent", "check", str(REPO / "examples/agents/openai_sdk_agent.yaml"), "--tasks", "2",
                                   f"model.path={tiny_model_dir}"])
    assert res.exit_code == 0, res.output
    assert set(_rows(res.output).values()) == {"PASS"}, res.output
    assert re.search(r"rewards \[-?\d\.\d+, -?\d\.\d+\]", res.output), res.output  # the env scored "Answer: 42"


AGENT = """
import json, os, sys, time
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
messages = list(task["messages"])

def resend(reply):  # how this agent keeps a reply in its history (verbatim here)
    return reply.model_dump(exclude_none=True)

def title():  # a side call after the answer (none here)
    pass

def hang():  # whether this episode hangs (never here)
    return False

for _ in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"]).choices[0].message
    messages.append(resend(reply))
    if not reply.tool_calls:
        break
    for call in reply.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
title()
if hang():  # after its work: it never exits
    time.sleep(600)
"""


def _check(tmp_path, tiny_model_dir, agent, *args):
    program = tmp_path / "agent.py"
    program.write_text(textwrap.dedent(agent))
    res = CliRunner().invoke(app, ["agent", "check", str(program), "--model", str(tiny_model_dir), *args])
    return res, _rows(res.output)


def test_a_hanging_agent_is_a_timeout_row_and_the_other_tasks_still_run(tiny_model_dir, tmp_path):
    hangs_once = AGENT.replace("    return False", '    return task["sample_id"].endswith("/0")')
    res, rows = _check(tmp_path, tiny_model_dir, hangs_once, "--tasks", "2", "--timeout-s", "8")
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert res.exit_code == 1 and len(rows) == 11, res.output  # the whole table
    assert rows["timeout"] == "FAIL" and rows["runs"] == rows["output file"] == "PASS", res.output
    assert "agent exceeded rollout.agent.timeout_s=8.0" in res.output
    assert "4 requests over 2 tasks" in res.output  # the second task ran too: a call, then the answer
    assert res.output.strip().endswith("10/11 checks passed; failed: timeout")


def test_a_bad_output_file_has_its_own_row(tiny_model_dir, tmp_path):
    bad_output = AGENT + 'open(os.environ["RELAX_OUTPUT_FILE"], "w").write("[1, 2")\n'
    res, rows = _check(tmp_path, tiny_model_dir, bad_output, "--tasks", "1")
    assert res.exit_code == 1 and rows["output file"] == "FAIL", res.output
    assert rows["runs"] == rows["timeout"] == "PASS" and "RELAX_OUTPUT_FILE is not valid JSON" in res.output


TITLE = """
    client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "Give this conversation a short title: " + (messages[-1]["content"] or "")}])
"""


def test_a_title_side_call_is_diagnosed_as_a_side_call_only(tiny_model_dir, tmp_path):
    with_title = AGENT.replace("def title():  # a side call after the answer (none here)\n    pass\n",
                               "def title():" + TITLE)
    res, rows = _check(tmp_path, tiny_model_dir, with_title, "--tasks", "1")
    assert res.exit_code == 0, res.output
    assert {k for k, v in rows.items() if v != "PASS"} == {"nothing dropped"} and rows["nothing dropped"] == "WARN"
    assert "request 2: its messages do not hold the task's (a side call, e.g. a title)" in res.output


def test_a_re_templated_history_is_a_warning_that_names_the_change(tiny_model_dir, tmp_path):
    retemplated = AGENT.replace("    return reply.model_dump(exclude_none=True)",
                                '    out = reply.model_dump(exclude_none=True)\n'
                                '    out["content"] = "Thought: " + " ".join((reply.content or "").split())\n'
                                '    return out')
    res, rows = _check(tmp_path, tiny_model_dir, retemplated, "--tasks", "1")
    assert res.exit_code == 0, res.output  # it trains: every reply once, scored on its final answer
    assert rows["history verbatim"] == "WARN" and rows["final answer"] == "PASS", res.output
    assert "request 1 assistant message 0 holds reply 0 inside a longer text (annotated or prefixed): " \
           "a new context, re-rendered" in res.output
    assert rows["nothing dropped"] == "PASS" and rows["tools sent"] == "PASS", res.output


def test_an_agent_that_drops_the_text_beside_its_tool_calls_fails_history_verbatim(tiny_model_dir, tmp_path):
    drops_text = AGENT.replace("    return reply.model_dump(exclude_none=True)",
                               '    return {"role": "assistant", "tool_calls": [c.model_dump() for c in reply.tool_calls]} '
                               'if reply.tool_calls else reply.model_dump(exclude_none=True)')
    res, rows = _check(tmp_path, tiny_model_dir, drops_text, "--tasks", "1")
    assert res.exit_code == 1 and rows["history verbatim"] == "FAIL", res.output
    assert "request 1 assistant message 0 is reply 0's tool calls without the text beside them " \
           "('I will use a tool.')" in res.output
