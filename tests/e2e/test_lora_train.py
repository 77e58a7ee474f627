"""LoRA through the real CLI: the engine samples from merged weights, checkpoints hold the merged model and
the adapter, and a resume continues exactly (adapter and optimizer over the original base)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_train_cli import REPO, _cli, _responses

pytestmark = pytest.mark.slow
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    common = [f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
              "eval.at_end=false", "engine.max_batch_size=1", "run.num_threads=1", "trainer.lora.rank=4",
              "trainer.lr=5e-3"]
    a, b = base / "a", base / "b"
    full = _cli(*common, f"run.output_dir={a}", "trainer.steps=3", cwd=REPO)
    assert full.returncode == 0, full.stderr[-3000:]
    first = _cli(*common, f"run.output_dir={b}", "trainer.steps=2", cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _cli(*common, f"run.output_dir={b}", "trainer.steps=3", "--resume", cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return a, b


def test_lora_checkpoints_hold_a_merged_model_that_moved_and_an_adapter(runs, tiny_model_dir):
    a, _ = runs
    model = a / "checkpoints" / "step_000003" / "model"
    before, after = load_file(str(Path(tiny_model_dir) / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert set(after) == set(before)  # plain names: loadable by anything that loads the base
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("q_proj" in k for k in moved) and not any("embed_tokens" in k for k in moved)
    config = json.loads((model / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    rows = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if "rollout/reward" in r] == [1, 2, 3]


def test_lora_resume_is_exact(runs):
    a, b = runs
    assert _responses(a, 3) == _responses(b, 3)  # the engine sampled from the same merged weights
    wa = load_file(str(a / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
