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
    assert len(rows) == 9 and set(rows.values()) == {"PASS"}, res.output
    assert "4 requests over 2 tasks" in res.output  # a tool call, then the answer, per task
    assert "9/9 checks passed" in res.output


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
