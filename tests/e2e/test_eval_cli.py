"""``relax-agent eval`` on the tiny random policy: per-sample JSON lines, failure table, ``--bfcl``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _eval(tiny_model_dir: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "relax_agent.cli", "eval", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
           f"run.output_dir={tmp_path / 'run'}", "run.num_threads=1", *args]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_eval_writes_every_sample_and_a_failure_table(tiny_model_dir, tmp_path):
    out = _eval(tiny_model_dir, tmp_path, "eval.num_tasks=3", "eval.seeds=[0,1]", "--output", str(tmp_path / "e.json"))
    summary = json.loads((tmp_path / "e.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "e.samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and summary["eval/samples_path"] == str(tmp_path / "e.samples.jsonl")
    assert sorted({(r["task_id"], r["seed"]) for r in lines}) == sorted({(r["task_id"], s) for r in lines for s in (0, 1)})
    for r in lines:
        assert set(r) >= {"task_id", "prompt", "response", "parsed_calls", "verdict"}
        assert r["prompt"][-1]["role"] == "user" and len(r["response"]) == len(r["parsed_calls"]) == 1
        assert set(r["verdict"]) >= {"correct", "reward", "reason"} and r["verdict"]["reason"]
    failures = sum(1 for r in lines if not r["verdict"]["correct"])
    assert sum(n for _, n in summary["eval/failure_reasons"]) == failures
    assert "most common failure reasons" in out.stderr or failures == 0


def test_eval_bfcl_runs_every_category_and_groups_them(tiny_model_dir, tmp_path):
    from relax_agent.evaluation import bfcl_env_ids

    _eval(tiny_model_dir, tmp_path, "eval.num_tasks=1", "eval.seeds=[0]", "--bfcl", "--output", str(tmp_path / "b.json"))
    result = json.loads((tmp_path / "b.json").read_text())
    categories = set(bfcl_env_ids().values())
    assert set(result["categories"]) == categories and len(categories) == 17
    assert {p.stem for p in (tmp_path / "b.samples").iterdir()} == categories
    assert set(result["leaderboard"]) == {"non_live_ast", "live", "multi_turn", "irrelevance", "relevance", "overall"}
    for category, res in result["categories"].items():
        assert res["eval/num_tasks"] == 1 and 0.0 <= res["eval/accuracy"] <= 1.0, category
