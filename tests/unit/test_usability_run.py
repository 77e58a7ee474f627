"""What a user sees during a run: no silent `loss nan`, failures counted, cut-off replies named,
config changes on resume listed, the tiny-model command that the examples name works."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from relax_agent.config import dump_config, load_config
from relax_agent.control.reporting import rollout_metrics
from relax_agent.control.resume import check_resume_tasks, format_resume_changes, resume_changes
from relax_agent.envs import TextEnv
from relax_agent.errors import CheckpointError
from relax_agent.progress import format_eval, format_step
from relax_agent.records import Trajectory
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser


def _traj(i: int, reward: float, status: str = "ok") -> Trajectory:
    return Trajectory(f"s/g0/{i}", "s/g0", "t0", (1, 2), (0, 1), (0.0, -1.0), 1, (), reward, reward_status=status,
                      stop_reason="env_error" if status != "ok" else "terminated")


def test_a_step_without_update_says_why_instead_of_loss_nan():
    row = {**rollout_metrics([_traj(i, 1.0) for i in range(4)], 1.0), "train/samples": 0.0}
    line = format_step(3, row)
    assert "no update (all groups uniform)" in line and "nan" not in line and "failed" not in line
    assert "loss 0.1250" in format_step(3, {**row, "train/loss": 0.125})


def test_failed_episodes_show_on_the_step_line():
    all_failed = rollout_metrics([_traj(i, 0.0, "error") for i in range(4)], 1.0)
    assert all_failed["rollout/failed"] == 4.0 and all_failed["rollout/episodes"] == 4.0
    line = format_step(1, {**all_failed, "train/samples": 0.0})
    assert "no update (every episode failed)" in line and "failed 4/4 episodes" in line
    some = rollout_metrics([_traj(0, 0.0, "timeout"), _traj(1, 1.0), _traj(2, 0.0)], 1.0)
    assert "failed 1/3 episodes" in format_step(1, {**some, "train/loss": 0.5})


def test_failed_episodes_show_on_the_eval_line():
    result = {"eval/num_tasks": 4, "eval/seeds": [0, 1], "eval/accuracy": 0.0, "eval/accuracy_std": 0.0,
              "eval/well_formed": 0.0, "eval/well_formed_std": 0.0, "eval/reward": 0.0}
    assert "failed" not in format_eval({**result, "eval/failed": 0.0})
    assert format_eval({**result, "eval/failed": 4.0}).endswith("failed 4/4 episodes per seed")


class _Env(TextEnv):
    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return [{"role": "user", "content": "answer"}], {"tools": []}

    def step(self, action):
        return [], 1.0, True, False, {}


class _Engine:
    def __init__(self, finish):
        self.finish = finish

    async def generate(self, prompt_ids, params):
        return Generation((42,) * params.max_new_tokens, (-0.1,) * params.max_new_tokens, self.finish, 0)


@pytest.mark.parametrize("finish, stop", [("length", "length"), ("stop", "terminated")])
def test_a_reply_cut_off_by_max_new_tokens_is_recorded_as_length(tiny_model_dir, finish, stop):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=2)
    traj = asyncio.run(run_episode(_Env(), spec, _Engine(finish), ChatRenderer(tok), HermesParser(), SamplingParams(4)))
    assert traj.error is None and traj.stop_reason == stop and traj.turns[-1].finish_reason == finish


def _checkpoint(out_dir, cfg, num_tasks):
    ckpt = out_dir / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(dump_config(cfg))
    state = {"step": 2, "policy_version": 2, "groups_drawn": 4,
             "sampler": {"epoch": 0, "offset": 4, "num_tasks": num_tasks, "seed": 0}}
    (ckpt / "state.json").write_text(json.dumps(state))
    for name in ("trainer.pt", "rng.pt", "model/weights.bin"):  # placeholders: these tests never load them
        (ckpt / name).parent.mkdir(exist_ok=True)
        (ckpt / name).write_bytes(b"x")
    return ckpt


def test_resume_changes_list_old_and_new_values_and_name_the_breaking_ones(tmp_path):
    old = load_config(None, ["trainer.lr=1e-3", "env.kwargs={difficulty: 1}"])
    ckpt = _checkpoint(tmp_path, old, 10)
    new = load_config(None, ["trainer.lr=1e-4", "rollout.group_size=4", "env.kwargs={difficulty: 2}"])
    assert resume_changes(ckpt, new) == [("env.kwargs.difficulty", 1, 2, True), ("rollout.group_size", 8, 4, True),
                                         ("trainer.lr", 1e-3, 1e-4, False)]
    assert resume_changes(ckpt, old) == []
    text = format_resume_changes(ckpt, resume_changes(ckpt, new))
    assert "  trainer.lr: 0.001 → 0.0001\n" in text
    assert "  rollout.group_size: 8 → 4  (breaks exact resume)" in text


def test_a_train_split_of_another_size_names_env_id_and_kwargs(tmp_path):
    cfg = load_config(None, ["env.id=relax/Calculator-v0", "env.kwargs.num_tasks=20"])
    ckpt = _checkpoint(tmp_path, cfg, 1832)
    with pytest.raises(CheckpointError) as err:
        check_resume_tasks(ckpt, 18, cfg)
    assert "train split of 1832 tasks, this run has 18" in str(err.value)
    assert "env.id or env.kwargs changed" in str(err.value) and "relax/Calculator-v0" in str(err.value)
    check_resume_tasks(ckpt, 1832, cfg)  # same size: no error


def _resume_cli(tmp_path, saved, ckpt_tasks, *overrides):
    from relax_agent.cli import app
    from relax_agent.envs.calculator import CalculatorEnv

    base = [f"run.output_dir={tmp_path / 'run'}", "env.id=relax/Calculator-v0", "env.kwargs.num_tasks=20",
            "model.path=/nonexistent/model", "run.device=cpu", "rollout.tasks_per_step=2"]
    n_train = len(CalculatorEnv(num_tasks=20).tasks("train"))
    _checkpoint(tmp_path / "run" / "checkpoints", load_config("examples/tiny.yaml", base + saved), n_train if ckpt_tasks is None else ckpt_tasks)
    return CliRunner().invoke(app, ["train", "examples/tiny.yaml", *base, *overrides, "--resume", "--quiet"])


def test_cli_resume_warns_about_changed_keys_before_the_model_loads(tmp_path):
    out = _resume_cli(tmp_path, ["run.seed=0", "trainer.lr=1e-3"], None, "run.seed=7", "trainer.lr=1e-4")
    lines = out.output.splitlines()
    assert lines[1:3] == ["  run.seed: 0 → 7  (breaks exact resume)", "  trainer.lr: 0.001 → 0.0001"]
    warning = out.output.index("run.seed: 0 → 7  (breaks exact resume)")
    assert warning < out.output.index("loading policy ")
    assert out.exit_code == 1  # the checkpoint here has no real model: loading fails, after the warning


def test_cli_resume_refuses_another_train_split_before_the_model_loads(tmp_path):
    out = _resume_cli(tmp_path, [], 1832)
    assert out.exit_code == 1 and "train split of 1832 tasks" in out.output and "loading policy" not in out.output


def test_the_tiny_model_command_of_the_examples_writes_the_tiny_model(tmp_path, tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "relax_agent.models", "tiny", str(tmp_path / "m"), "--seed", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


class _NanEnv(_Env):
    def step(self, action):
        return [], float("nan"), True, False, {}


def test_contract_reports_a_nan_reward_as_non_finite_not_as_nondeterminism():
    from relax_agent.envs.testing import run_contract

    failures = run_contract(_NanEnv, ["determinism", "step"])
    assert "determinism" not in failures
    assert failures["step"].endswith("reward must be finite, got nan")
