"""Task order, checkpoints and metrics files: the parts of a run that make resume exact."""

import json

import pytest

from relax_agent.checkpoint import CheckpointManager, resolve
from relax_agent.errors import CheckpointError, DataError
from relax_agent.metrics import MetricsLogger, plot_curves, read_metrics
from relax_agent.sampler import TaskSampler


def test_sampler_is_a_seeded_permutation_per_epoch_and_resumes_exactly():
    s = TaskSampler(5, seed=3)
    first = s.next(3) + s.next(3)  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and s.epoch == 1 and s.offset == 1
    state = s.state_dict()
    expected = s.next(7)
    t = TaskSampler(5, seed=3)
    t.load_state_dict(state)
    assert t.next(7) == expected
    assert TaskSampler(5, seed=4).next(5) != TaskSampler(5, seed=3).next(5)


def test_sampler_refuses_empty_data_and_a_different_dataset():
    with pytest.raises(DataError):
        TaskSampler(0, seed=0)
    with pytest.raises(CheckpointError, match="5 tasks, this run has 6"):
        TaskSampler(6, 0).load_state_dict(TaskSampler(5, 0).state_dict())


def _save_model(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "weights.txt").write_text("w")


def test_checkpoints_are_pruned_and_half_written_ones_ignored(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, _save_model, {"opt": step}, {"policy_version": step}, "a: 1\n")
    assert [p.name for p in m.all()] == ["step_000002", "step_000003"]
    (tmp_path / "checkpoints" / ".step_000004.tmp").mkdir()  # a crash mid-save
    (tmp_path / "checkpoints" / "step_000005").mkdir()        # no state.json: incomplete
    assert resolve(tmp_path).name == "step_000003"
    assert json.loads((resolve(tmp_path) / "state.json").read_text()) == {"step": 3, "policy_version": 3}
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve(tmp_path / "nowhere")


def test_metrics_keep_the_last_row_per_step_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(0, {"eval/accuracy": 0.1, "eval/accuracy_std": 0.01})
    log.log(1, {"rollout/reward": 0.5, "bad": float("nan")})
    log.log(1, {"rollout/reward": 0.7})  # the step redone after a resume
    log.log(2, {"rollout/reward": 0.9})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("rollout/reward")) for r in rows] == [(0, None), (1, 0.7), (2, 0.9)]
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "p.png").stat().st_size > 5000


def _three_checkpoints(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        m.save(step, _save_model, {"opt": step}, {"policy_version": step}, "a: 1\n")
    return m, tmp_path / "checkpoints"


@pytest.mark.parametrize("damage, problem", [
    (lambda c: (c / "trainer.pt").write_bytes(b""), "trainer.pt is empty"),
    (lambda c: (c / "state.json").write_text("{not json"), "state.json is not valid JSON"),
    (lambda c: (c / "model" / "weights.txt").write_bytes(b""), "weights.txt is empty"),
    (lambda c: (c / "rng.pt").unlink(), "rng.pt is missing"),
])
def test_resume_skips_a_broken_newest_checkpoint_naming_the_file(tmp_path, damage, problem):
    from relax_agent.checkpoint import load_state

    m, root = _three_checkpoints(tmp_path)
    damage(root / "step_000003")
    with pytest.warns(UserWarning, match=problem):
        assert m.latest().name == "step_000002"
    with pytest.raises(CheckpointError, match=problem):
        load_state(root / "step_000003")


def test_a_truncated_trainer_state_is_an_error_naming_the_file(tmp_path):
    from relax_agent.checkpoint import load_state

    _, root = _three_checkpoints(tmp_path)
    f = root / "step_000003" / "trainer.pt"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="trainer.pt is corrupt or truncated"):
        load_state(root / "step_000003")


def test_stray_folders_beside_checkpoints_are_ignored(tmp_path):
    m, root = _three_checkpoints(tmp_path)
    (root / "step_best").mkdir()
    (root / "step_best" / "state.json").write_text("{}")
    (root / "notes").mkdir()
    assert [p.name for p in m.all()] == ["step_000001", "step_000002", "step_000003"]
    assert m.latest().name == resolve(tmp_path).name == "step_000003"


@pytest.mark.parametrize("where, problem", [("file", "is a file"), ("/proc/relax-run", "not writable")])
def test_an_output_dir_that_cannot_be_written_fails_in_preflight(tmp_path, where, problem):
    from relax_agent.errors import ConfigError
    from relax_agent.preflight import check_output_dir

    path = tmp_path / "a-file" if where == "file" else where
    if where == "file":
        path.write_text("x")
    with pytest.raises(ConfigError, match=f"run.output_dir=.*{problem}"):
        check_output_dir(str(path))


def test_a_run_folder_the_run_creates_is_its_owners_alone(tmp_path):
    """Checkpoints (trainer.pt), rollout dumps and the token record were world-readable (0644 in a 0755 folder)."""
    import stat

    from relax_agent.preflight import check_output_dir

    check_output_dir(str(tmp_path / "runs" / "new"))
    assert stat.S_IMODE((tmp_path / "runs" / "new").stat().st_mode) == 0o700
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    check_output_dir(str(mine))  # a folder the user made is left as they made it
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755


def test_an_env_whose_prompts_carry_images_is_refused_at_start_up_for_a_text_only_policy():
    from relax_agent.errors import ConfigError
    from relax_agent.preflight import check_env_prompt

    class ImageEnv:
        def reset(self, seed=None, options=None):
            return [{"role": "user", "content": [{"type": "text", "text": "count"},
                                                 {"type": "image_url", "image_url": {"url": "data:,"}}]}], {}

    with pytest.raises(ConfigError, match=r"env.reset observation\[0\] has a 'image_url' content part"):
        check_env_prompt(ImageEnv(), {"id": "t"}, seed=0)
    check_env_prompt(ImageEnv(), {"id": "t"}, seed=0, accepts_media=True)


def test_the_plot_gets_a_replicas_and_restarts_panel_for_a_ray_run(tmp_path):
    from PIL import Image

    log = MetricsLogger(tmp_path, tensorboard=False)
    for step, (replicas, restarts) in enumerate([(1, 0), (2, 0), (2, 1), (1, 1)], start=1):
        log.log(step, {"rollout/reward": 0.1 * step, "runtime/rollout_replicas": replicas,
                       "runtime/rollout_target": replicas, "runtime/rollout_restarts": restarts,
                       "runtime/trainer_restarts": 0})
    log.close()
    plain = MetricsLogger(tmp_path / "plain", tensorboard=False)
    plain.log(1, {"rollout/reward": 0.1})
    plain.close()
    with_roles = Image.open(plot_curves(tmp_path / "metrics.jsonl", tmp_path / "p.png"))
    without = Image.open(plot_curves(tmp_path / "plain" / "metrics.jsonl", tmp_path / "q.png"))
    assert with_roles.width > without.width  # a third panel
