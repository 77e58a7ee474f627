"""A tiny random policy carrying Qwen3's real chat template (thinking on: the generation prompt leaves
the <think> block to the policy) trains two GRPO steps of the main job's task through the CLI, with
``rollout.tool_parser: auto`` choosing the qwen3 parser. The template is not append-only (it drops
past reasoning); the run is accepted and completes both steps, and the replay of its token records
finds every trained token to be a sampled one, scored by the sampling policy as recorded."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow
pytest.importorskip("bfcl_eval")

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "tests" / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"


def test_a_qwen3_template_policy_trains_two_steps_with_tool_parser_auto(tiny_model_dir, tmp_path):
    model = tmp_path / "tiny-qwen3-template"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = QWEN3.read_text()  # <think>/<tool_call> stay plain text: the vocabulary is unchanged
    tok.save_pretrained(model)
    out = tmp_path / "run"
    overrides = [
        f"model.path={model}", f"run.output_dir={out}", "rollout.tool_parser=auto",
        "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=16",
        "trainer.sft_warmup_steps=0", "trainer.steps=2", "trainer.micro_batch_size=1", "trainer.lr=1e-3",
        "eval.at_start=false", "eval.num_tasks=1", "eval.seeds=[0]", "checkpoint.every_steps=0",
        "logging.tensorboard=false", "logging.plot=false",
    ]
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/bfcl.yaml", *overrides, "--quiet"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tool parser: qwen3 (chat template has <tool_call> JSON calls and <think> reasoning)" in done.stderr
    assert "tools in: template (the chat template renders the tool schemas its own way)" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
    for step in (1, 2):
        samples = [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 2 and all(s["error"] is None and s["response"] for s in samples)

    from relax_agent.config import ModelConfig
    from relax_agent.models import load_policy
    from relax_agent.replay import load_token_record, replay_records
    from relax_agent.rollout.chat import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), "auto", None, True)
    base = load_policy(ModelConfig(path=str(model)))[0]
    for step in (1, 2):
        records = load_token_record(out, step)
        assert sum(len(t["token_ids"]) for r in records for t in r["turns"]) > 0
        load = {0: base}.get if step == 1 else None  # step 1 was sampled by the initial weights
        reports = replay_records(records, renderer, load, 0.7, 2e-3)  # examples/bfcl.yaml: temperature 0.7
        assert [r.divergence for r in reports] == [None] * len(records), [r.divergence for r in reports]
