"""A run with ``env.warmup_fraction``: the warm-up demonstrates only its own pool's tasks and RL draws
only from the other pool, never a held-out task or a near-duplicate of one (tiny real model)."""

import json
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers the relax/ ids)
from relax_agent.pools import near_duplicate

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_warm_up_and_rl_draw_from_disjoint_pools(tiny_model_dir, tmp_path):
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_roles

    cfg = load_config(REPO / "examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "eval.at_start=false", "eval.at_end=false", "logging.tensorboard=false",
        "logging.plot=false", "trainer.steps=2", "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=4",
        "trainer.sft_lr=1e-3", "checkpoint.every_steps=0", f"run.output_dir={tmp_path}",
        "env.warmup_fraction=0.5", "env.near_duplicate_jaccard=0.5", "rollout.tasks_per_step=4",
        "env.kwargs={train_categories: [multiple]}"])
    ctrl = build_controller(cfg, build_roles(cfg))
    shown: list[str] = []
    demonstrations = ctrl.runtime.rollout.demonstrations

    def recording(tasks, seed):
        shown.extend(t["id"] for t in tasks)
        return demonstrations(tasks, seed)

    ctrl.runtime.rollout.demonstrations = recording  # type: ignore[method-assign]
    try:
        summary = ctrl.train()
        pools, heldout = ctrl.pools, ctrl.runtime.heldout_tasks
    finally:
        ctrl.close()
    warm, rl = {t["id"] for t in pools.warmup}, {t["id"] for t in pools.rl}
    assert shown == [t["id"] for t in pools.warmup] and not warm & rl
    assert len(warm) + len(rl) + len(pools.dropped) == 327 + 161
    env = gymnasium.make("relax/BFCL-simple-v0")
    with_demo = sum(env.unwrapped.demonstration(t) is not None for t in pools.warmup)
    env.close()
    assert summary["sft"]["sft/demonstrations"] == with_demo > 0.95 * len(warm)
    drawn = [json.loads(line)["task_id"] for step in (1, 2)
             for line in (tmp_path / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(drawn) == 2 * 4 * 4 and set(drawn) <= rl and not set(drawn) & warm
    held = {t["id"] for t in heldout}
    assert not set(drawn) & held
    by_id = {t["id"]: t for t in pools.rl}
    assert not any(near_duplicate(by_id[i], h, 0.5) for i in set(drawn) for h in heldout)
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["sampler"]["num_tasks"] == len(rl)  # a resume checks RL's pool, not the whole split
