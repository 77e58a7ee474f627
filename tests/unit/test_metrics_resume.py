"""A resumed run leaves one row set per step in ``metrics.jsonl``: the rows of the steps it redoes move to
``metrics.superseded.jsonl`` (kept, not lost)."""

from __future__ import annotations

import json

from relax_agent.metrics import MetricsLogger, read_metrics


def test_rows_after_the_resumed_step_move_to_the_superseded_file(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(5):
        log.log(step, {"rollout/reward": step / 10})
    log.log(2, {"eval/accuracy": 0.5})
    with log.path.open("a") as f:
        f.write('{"step": 5, "rollout/rew')  # the half line a crash leaves
    assert log.supersede_after(2) == 3
    kept = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2, 2] and kept[-1]["eval/accuracy"] == 0.5
    moved = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [3, 4] and moved[2] == '{"step": 5, "rollout/rew'
    log.log(3, {"rollout/reward": 0.9})  # the redone step
    assert [(r["step"], r.get("rollout/reward")) for r in read_metrics(log.path)][-2:] == [(2, None), (3, 0.9)]
    assert log.supersede_after(3) == 0 and not (tmp_path / "metrics.jsonl.tmp").exists()
