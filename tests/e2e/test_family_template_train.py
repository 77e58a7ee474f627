"""Every policy family end to end: a tiny random policy whose tokenizer carries the family's real chat
template and special tokens (``tests/unit/test_family_templates.py``'s table; the model's vocabulary
covers the added tokens) trains one GRPO step of the main job's task through the CLI with
``rollout.tool_parser: auto``. The run log names the family's parser and how its tools are rendered,
the step completes, and the replay of its token record finds every trained token a sampled one,
every delta the template's, scored by the initial policy as recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.unit.test_family_templates import FAMILIES, TEMPLATES

pytestmark = pytest.mark.slow
pytest.importorskip("bfcl_eval")

REPO = Path(__file__).resolve().parents[2]
PARSER = {family: family for family in FAMILIES} | {"deepseek_v3": "hermes_strict"}  # V3.1 renders no tools


def _family_policy(family, tiny_model_dir, out):
    from relax_agent.models import make_tiny_model

    name, special, plain, roles, _, _ = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(special, special_tokens=True)
    tok.add_tokens(plain)
    if roles:
        tok.add_special_tokens(roles)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    make_tiny_model(out, arch="llama", seed=0, vocab_size=len(tok))
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_template_policy_trains_one_step_with_tool_parser_auto(family, tiny_model_dir, tmp_path):
    model = _family_policy(family, tiny_model_dir, tmp_path / f"tiny-{family}")
    out = tmp_path / "run"
    overrides = [
        f"model.path={model}", f"run.output_dir={out}", "rollout.tool_parser=auto",
        "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=16",
        "trainer.sft_warmup_steps=0", "trainer.steps=1", "trainer.micro_batch_size=1", "trainer.lr=1e-3",
        "eval.at_start=false", "eval.num_tasks=1", "eval.seeds=[0]", "checkpoint.every_steps=0",
        "logging.tensorboard=false", "logging.plot=false",
    ]
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/bfcl.yaml", *overrides, "--quiet"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tool parser: {PARSER[family]} (" in done.stderr
    assert ("tools in: system prompt" if family == "deepseek_v3" else "tools in: template") in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1]
    samples = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["error"] is None for s in samples)

    from relax_agent.config import ModelConfig
    from relax_agent.models import load_policy
    from relax_agent.replay import load_token_record, replay_records
    from relax_agent.rollout.chat import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), "auto", None, True)
    base = load_policy(ModelConfig(path=str(model)))[0]
    records = load_token_record(out, 1)
    assert sum(len(t["token_ids"]) for r in records for t in r["turns"]) > 0
    reports = replay_records(records, renderer, {0: base}.get, 0.7, 2e-3)  # examples/bfcl.yaml: temperature 0.7
    assert [r.divergence for r in reports] == [None] * len(records), [r.divergence for r in reports]
