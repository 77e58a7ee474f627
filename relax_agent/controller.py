"""Control plane: drives a run step by step (colocate mode: rollout -> train -> weight sync).

Each step: draw ``rollout.tasks_per_step`` tasks, play ``group_size`` episodes per task,
compute GRPO advantages, train on the batch, publish the new weights to the engine (policy
version + 1), log, checkpoint. Ctrl-C stops cleanly: an interrupted rollout is discarded,
an update in flight is finished, and a checkpoint of the last complete step is written.
``mode: async`` runs the same steps with rollout and training overlapped
(:mod:`relax_agent.async_controller`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

from relax_agent import metrics as M
from relax_agent.checkpoint import CheckpointManager, load_state
from relax_agent.config import RelaxConfig, dump_config
from relax_agent.errors import CheckpointError
from relax_agent.evaluation import episode_accuracy, evaluate
from relax_agent.roles import Roles
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.records import Trajectory
from relax_agent.sampler import TaskSampler


def rollout_metrics(trajs: list[Trajectory], rollout_s: float) -> dict[str, float]:
    """Step metrics of a batch of trajectories (means over trainable samples)."""
    ok = [t for t in trajs if t.trainable]
    n_ok = max(len(ok), 1)
    generated = sum(len(turn.token_ids) for t in trajs for turn in t.turns)
    out = {
        M.REWARD: sum(t.reward for t in ok) / n_ok,
        M.ACCURACY: sum(episode_accuracy(t) for t in ok) / n_ok,
        M.FORMAT_RATE: sum(float(t.metrics.get("well_formed", 0.0)) for t in ok) / n_ok,
        M.TOKENS_PER_S: generated / max(rollout_s, 1e-9),
        "rollout/response_tokens": generated / max(len(trajs), 1),
        "rollout/failed": float(len(trajs) - len(ok)),
        "rollout/episodes": float(len(trajs)),
        "timing/rollout_s": rollout_s,
    }
    for reason, count in Counter(t.stop_reason for t in trajs).items():
        out[f"stop/{reason}"] = float(count)
    return out


EXACT_RESUME_KEYS = ("rollout.tasks_per_step", "rollout.group_size", "env.id", "env.kwargs", "run.seed")
"""Config keys (``env.kwargs`` and everything under it) whose change makes a resumed run draw
different tasks or seeds than the uninterrupted run would have."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_changes(ckpt: Path, cfg: RelaxConfig) -> list[tuple[str, Any, Any, bool]]:
    """``(dotted key, checkpoint value, current value, breaks exact resume)`` for every key whose
    value differs between ``ckpt/config.yaml`` and ``cfg``; a key missing on one side has
    value ``None`` there. Empty when the checkpoint holds no config.yaml."""
    import yaml

    path = Path(ckpt) / "config.yaml"
    if not path.is_file():
        return []
    old = _flatten(yaml.safe_load(path.read_text()) or {})
    new = _flatten(yaml.safe_load(dump_config(cfg)))
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            breaks = any(key == k or key.startswith(k + ".") for k in EXACT_RESUME_KEYS)
            changes.append((key, old.get(key), new.get(key), breaks))
    return changes


def format_resume_changes(ckpt: Path, changes: list[tuple[str, Any, Any, bool]]) -> str:
    """A warning listing ``changes`` (see :func:`resume_changes`) as ``key: old → new``."""
    lines = [f"warning: the config differs from the checkpoint's ({Path(ckpt) / 'config.yaml'}); continuing with the new values:"]
    for key, old, new, breaks in changes:
        lines.append(f"  {key}: {old!r} → {new!r}" + ("  (breaks exact resume)" if breaks else ""))
    broken = [c[0] for c in changes if c[3]]
    if broken:
        lines.append(f"  changed {', '.join(broken)}: the resumed run draws other tasks or seeds than the "
                     "uninterrupted run would have")
    return "\n".join(lines)


def check_resume_tasks(ckpt: Path, num_train_tasks: int, cfg: RelaxConfig) -> None:
    """Raise CheckpointError when ``ckpt`` was taken on a train split of another size (cheap:
    reads ``state.json`` only, so it can run before the policy loads)."""
    state = json.loads((Path(ckpt) / "state.json").read_text())
    saved = state.get("sampler", {}).get("num_tasks")
    if saved is not None and saved != num_train_tasks:
        raise CheckpointError(
            f"checkpoint {ckpt} was taken on a train split of {saved} tasks, this run has {num_train_tasks} "
            f"(env.id={cfg.env.id!r}, env.kwargs={cfg.env.kwargs}); most likely env.id or env.kwargs changed "
            "since the checkpoint: restore them, or start a new run.output_dir"
        )


class StopRequest:
    """Ctrl-C handling for a run: the first SIGINT asks for a clean stop, the second aborts.

    The first SIGINT cancels a running rollout (its envs and sandboxes are closed by the
    cancelled episodes) and lets an update in flight finish, so weights, optimizer and
    policy version never disagree; the controller then saves the last complete step.
    Outside the main thread (no signals there) it does nothing.
    """

    def __init__(self) -> None:
        self.requested = False
        self._cancel: Callable[[], None] | None = None
        self._previous: Any = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, *_: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.requested = True
        if self._cancel is not None:
            self._cancel()

    def check(self) -> None:
        """Raise KeyboardInterrupt when a stop was requested."""
        if self.requested:
            raise KeyboardInterrupt

    def run(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """``asyncio.run(coro_fn())`` that a first Ctrl-C cancels (raising KeyboardInterrupt)."""

        async def main() -> Any:
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            self._cancel = lambda: loop.call_soon_threadsafe(task.cancel)
            return await coro_fn()

        try:
            result = asyncio.run(main())
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            self._cancel = None
        self.check()
        return result


class Controller:
    """Runs training (and evaluation) for one config.

    Args:
        cfg: the validated run config.
        roles: live policy, engine, trainer and runner (see :func:`relax_agent.roles.build_roles`).
        reporter: receives progress events (console bar); ``None`` for silence.
    """

    def __init__(self, cfg: RelaxConfig, roles: Roles, reporter: Any = None):
        self.cfg = cfg
        self.roles = roles
        self.reporter = reporter
        self.out = Path(cfg.run.output_dir)
        self.logger = M.MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard)
        self.ckpts = CheckpointManager(self.out, cfg.checkpoint.keep_last)
        self.sampler = TaskSampler(len(roles.train_tasks), cfg.run.seed)
        self.step = 0
        self.version = 0
        self.groups_drawn = 0
        """Rollout groups drawn by the last complete step (names and seeds the next ones)."""
        self.publish: Callable[[Any, int], Any] = roles.engine.load_weights
        """Sends ``(state_dict, version)`` to the rollout engine (async mode: the weight sync)."""
        self.stop = StopRequest()

    # -- resume -----------------------------------------------------------------------------
    def restore(self, ckpt: Path) -> None:
        """Continue from ``ckpt`` (the policy was already loaded from ``ckpt/model``)."""
        check_resume_tasks(ckpt, len(self.roles.train_tasks), self.cfg)
        state, trainer_state = load_state(ckpt)
        self.roles.trainer.load_state_dict(trainer_state)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.version = state["step"], state["policy_version"]
        self.groups_drawn = state.get("groups_drawn", self.step * self.cfg.rollout.tasks_per_step)
        self.roles.engine.load_weights(self.roles.trainer.policy_state_dict(), self.version)

    def save(self) -> Path:
        state = {"policy_version": self.version, "sampler": self.sampler.state_dict(), "groups_drawn": self.groups_drawn}
        trainer = self.roles.trainer
        return self.ckpts.save(self.step, trainer.model, self.roles.tokenizer, trainer.state_dict(), state, dump_config(self.cfg))

    # -- the loop ---------------------------------------------------------------------------
    def params(self, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, temperature or r.temperature, r.top_p)

    def train(self) -> dict[str, Any]:
        """Run until ``trainer.steps``; returns the last step's metrics and eval results."""
        summary: dict[str, Any] = {}
        with self.stop:
            try:
                if self.cfg.eval.at_start and self.step == 0:
                    summary["eval_start"] = self.run_eval()
                if self.cfg.mode == "async":
                    from relax_agent.async_controller import AsyncLoop

                    AsyncLoop(self).run()
                while self.step < self.cfg.trainer.steps:
                    summary["last"] = self.train_step()
                    if self._due(self.cfg.eval.every_steps) and self.step < self.cfg.trainer.steps:
                        self.run_eval()
                    if self._due(self.cfg.checkpoint.every_steps):
                        self.save()
                if self.cfg.eval.at_end:
                    summary["eval_end"] = self.run_eval()
            except KeyboardInterrupt:
                summary["interrupted"] = True
            finally:
                summary["checkpoint"] = str(self.save()) if self.cfg.trainer.steps else None
                summary["plot"] = str(self.plot()) if self.cfg.logging.plot else None
                self.logger.close()
        return summary

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def train_step(self) -> dict[str, Any]:
        """One colocated step: rollout, advantages, update, weight sync."""
        t0 = time.perf_counter()
        sampler_state = self.sampler.state_dict()
        try:
            trajs, rollout_s = self._rollout()
        except BaseException:
            self.sampler.load_state_dict(sampler_state)  # the interrupted step is redrawn on resume
            raise
        sample_version = self.version
        train_metrics, kept = self._update(trajs)  # a Ctrl-C here is honoured once the update is done
        self.step += 1
        self.groups_drawn += self.cfg.rollout.tasks_per_step
        self._dump_rollouts(trajs, [sample_version] * len(trajs), sample_version, kept)
        step_s = time.perf_counter() - t0
        row = {**rollout_metrics(trajs, rollout_s), **train_metrics, M.STEP_TIME: step_s,
               M.DATA_WAIT: rollout_s, M.SAMPLES_PER_S: len(trajs) / max(step_s, 1e-9), "policy_version": self.version}
        self.logger.log(self.step, row)
        self._report("step", row)
        self.stop.check()
        return row

    def _dump_rollouts(self, trajs: list[Trajectory], sample_versions: list[int], trained_at: int,
                       kept: set[str], dropped: set[str] = frozenset()) -> None:
        """``rollouts/step_NNNNNN.jsonl``: every sample of the step, failed ones included.

        Each row records ``sample_version`` (engine policy version when its group started),
        ``trained_at_version`` (the trainer's version when the step trained), ``trained``
        (it entered the gradient: trainable with a non-zero advantage) and ``dropped_stale``
        (async mode: its group finished too late for ``max_staleness`` and was not trained).
        """
        path = self.out / "rollouts" / f"step_{self.step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = self.roles.tokenizer
        with path.open("w") as f:
            for t, version in zip(trajs, sample_versions):
                response = [tok.decode(turn.token_ids) for turn in t.turns]
                f.write(json.dumps({
                    "sample_id": t.sample_id, "task_id": t.task_id, "reward": t.reward,
                    "reward_status": t.reward_status, "metrics": t.metrics, "stop_reason": t.stop_reason,
                    "error": t.error, "policy_versions": t.policy_versions, "response": response,
                    "sample_version": version, "trained_at_version": trained_at, "trained": t.sample_id in kept,
                    "dropped_stale": t.sample_id in dropped,
                }) + "\n")

    def _rollout(self) -> tuple[list[Trajectory], float]:
        r = self.cfg.rollout
        tasks = [self.roles.train_tasks[i] for i in self.sampler.next(r.tasks_per_step)]
        specs = self.roles.runner.specs(tasks, r.group_size, prefix=f"s{self.step}", seed=self.cfg.run.seed + self.step * 10_007)
        self._report("rollout_start", {"total": len(specs)})
        t0 = time.perf_counter()
        trajs = self.stop.run(lambda: self.roles.runner.run(specs, self.params(), on_done=lambda t: self._report("episode", {})))
        return trajs, time.perf_counter() - t0

    def _update(self, trajs: list[Trajectory], adv: Any = None) -> tuple[dict[str, float], set[str]]:
        """Train on ``trajs`` (advantages [B], default: their GRPO advantages) and publish the
        new version; returns the metrics and the ids of the samples that entered the gradient."""
        from relax_agent.train.batch import collate, trajectory_advantages

        if adv is None:
            adv = trajectory_advantages(trajs, std_normalize=self.cfg.trainer.adv_std_normalize)
        keep = [i for i, t in enumerate(trajs) if t.trainable and float(adv[i]) != 0.0]
        kept = {trajs[i].sample_id for i in keep}
        n_valid = sum(t.trainable for t in trajs)
        out = {"train/samples": float(len(keep)), "train/zero_advantage": float(n_valid - len(keep))}
        if not keep:
            return out, kept  # every group was uniform: no gradient, no new version
        batch = collate([trajs[i] for i in keep], adv[keep], self.roles.tokenizer.pad_token_id)
        t0 = time.perf_counter()
        out.update(self.roles.trainer.train_step(batch))
        out["timing/train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.version += 1
        stats = self.publish(self.roles.trainer.policy_state_dict(), self.version)
        out["timing/weight_sync_s"] = time.perf_counter() - t0
        if hasattr(stats, "as_metrics"):
            out.update(stats.as_metrics())
        return out, kept

    # -- evaluation and plots ---------------------------------------------------------------
    def run_eval(self, run: Callable[[Callable[[], Any]], Any] | None = None) -> dict[str, Any]:
        """Evaluate on the held-out tasks; ``run`` drives the coroutines (default: Ctrl-C cancels them)."""
        e = self.cfg.eval
        tasks = self.roles.heldout_tasks[: e.num_tasks]
        self._report("eval_start", {"total": len(tasks) * len(e.seeds)})
        result = evaluate(self.roles.runner, tasks, e.seeds, self.params(e.temperature),
                          on_done=lambda t: self._report("episode", {}), run=run or self.stop.run)
        self.logger.log(self.step, {k: v for k, v in result.items() if not isinstance(v, list)})
        self._report("eval", result)
        return result

    def plot(self) -> Path:
        return M.plot_curves(self.logger.path, self.out / "plots" / "curves.png")

    def _report(self, event: str, data: dict[str, Any]) -> None:
        if self.reporter is not None:
            self.reporter(event, self.step, data)
