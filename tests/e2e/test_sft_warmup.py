"""The supervised warm-up on a tiny real model: demonstrations rendered token-in/token-out, the
warm-up's weights published as a policy version before the first RL step, resume after it."""

import json
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_demonstrations_are_the_prompt_an_episode_renders_plus_the_parsed_reference_reply(tiny_model_dir):
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.demonstrations import demonstration_fields
    from relax_agent.rollout.parsers import build_parser

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    renderer, parser = ChatRenderer(tok), build_parser("hermes_strict")
    env = gymnasium.make("relax/BFCL-simple-v0")
    tasks = env.unwrapped.tasks("train")[:5]
    demos = demonstration_fields(lambda: gymnasium.make("relax/BFCL-simple-v0"), renderer, parser, tasks, seed=0)
    assert demos["task_id"] == [t["id"] for t in tasks]
    for task, ids, mask in zip(tasks, demos["token_ids"], demos["loss_mask"], strict=True):
        obs, info = env.reset(seed=0, options={"task": task})
        prompt = list(renderer.render_prompt(obs, info["tools"]).token_ids)
        assert list(ids[:len(prompt)]) == prompt and not mask[:len(prompt)].any() and mask[len(prompt):].all()
        reply = list(ids[len(prompt):])
        assert reply[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the turn's stop token is learned too
        action = parser.parse(tok.decode(reply, skip_special_tokens=True)).message()
        env.reset(seed=0, options={"task": task})
        assert env.step(action)[4]["correct"] == 1.0  # the demonstrated reply is judged correct


def test_a_warm_up_runs_before_rl_and_its_weights_are_the_first_rl_steps_policy(tiny_model_dir, tmp_path):
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_roles

    cfg = load_config(REPO / "examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "eval.at_start=false", "eval.at_end=false", "logging.tensorboard=false",
        "logging.plot=false", "trainer.steps=1", "trainer.sft_warmup_steps=3", "trainer.sft_batch_size=4",
        "trainer.sft_lr=1e-3", "checkpoint.every_steps=1", "checkpoint.keep_last=1", f"run.output_dir={tmp_path}"])
    ctrl = build_controller(cfg, build_roles(cfg))
    try:
        summary = ctrl.train()
    finally:
        ctrl.close()
    # the warm-up's own checkpoint (version 1) survives keep_last=1 beside the newest
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    warm = json.loads((tmp_path / "checkpoints" / "step_000000" / "state.json").read_text())
    assert (warm["step"], warm["policy_version"], warm["sft_done"], warm["groups_drawn"]) == (0, 1, True, 0)
    assert summary["checkpoint_warmup"] == str(tmp_path / "checkpoints" / "step_000000")
    sft = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["sft/step"] for r in sft] == [1, 2, 3] and all(r["sft/tokens"] > 0 for r in sft)
    assert summary["sft"]["policy_version"] == 1 and summary["sft"]["sft/demonstrations"] > 300
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert {r["sample_version"] for r in rows} == {1}  # the first RL rollout ran on the warm-up's weights
    state = json.loads((tmp_path / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["sft_done"] is True  # a resume does not warm up again


def test_a_run_resumed_from_the_warm_up_checkpoint_neither_warms_up_nor_evaluates_the_start_again(tiny_model_dir, tmp_path):
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_roles

    args = [f"model.path={tiny_model_dir}", "eval.at_end=false", "eval.num_tasks=2", "eval.seeds=[0]",
            "logging.tensorboard=false", "logging.plot=false", "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=4",
            "trainer.sft_lr=1e-3", f"run.output_dir={tmp_path}"]
    cfg = load_config(REPO / "examples/tiny.yaml", args + ["trainer.steps=0"])  # a crash right after the warm-up
    ctrl = build_controller(cfg, build_roles(cfg))
    try:
        first = ctrl.train()
    finally:
        ctrl.close()
    assert "eval_start" in first and first["checkpoint"] == first["checkpoint_warmup"] == str(tmp_path / "checkpoints" / "step_000000")
    sft_log = (tmp_path / "sft.jsonl").read_text()

    cfg = load_config(REPO / "examples/tiny.yaml", args + ["trainer.steps=1"])
    ckpt = tmp_path / "checkpoints" / "step_000000"
    ctrl = build_controller(cfg, build_roles(cfg, model_path=ckpt / "model"))
    try:
        ctrl.restore(ckpt)
        second = ctrl.train()
    finally:
        ctrl.close()
    assert "sft" not in second  # not warmed up again
    # the untrained policy is gone: its score is the first run's, carried into the summary, not evaluated again
    assert second["eval_start"]["eval/accuracy"] == first["eval_start"]["eval/accuracy"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "eval/accuracy" in m and m["step"] == 0]) == 1
    assert (tmp_path / "sft.jsonl").read_text() == sft_log
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert {r["sample_version"] for r in rows} == {1}
