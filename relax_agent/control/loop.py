"""The one control loop: env -> rollout -> data bus (fields) -> advantages -> trainer -> weight sync.

Every run, whatever its mode, flows the same way. Rollout producers ask the rollout service
to play GRPO groups; the service writes each finished group's fields into the TransferQueue
partition ``rollouts`` (token ids, loss mask, rollout log-probs, reward, trainable, routed
experts for replay, each episode's scalars, the trajectory for the dump). The advantage consumer reads each
complete group's rewards and writes its ``advantage`` field. The trainer side takes whole
groups as they complete (one long-tail episode holds only its own group), drops those that
would exceed ``max_staleness``, with dynamic sampling (``rollout.dynamic_sampling``) retires
those whose rewards do not vary and lets the producers draw others in their place, and once it
has ``rollout.tasks_per_step`` groups names their trainable rows to the trainer service (a
:class:`~relax_agent.runtime.base.TrainRef`; the loop itself reads only the advantage, the trainable
flag, the episode scalars its metrics come from, and the trajectory for the rollout dump), which reads them from the bus, trains one step and publishes the new
weights through the weight sync (the engine applies them between decode batches); then the groups
are acked. When the trainer service may replay updates after a restart (``runtime: ray``), the rows
of the updates since the newest checkpoint stay on the bus until a checkpoint covers them.

The schedule (:mod:`relax_agent.control.schedule`) is the only difference between modes:
``colocate`` is staleness 0 with weights copied in-process; ``async`` allows ``max_staleness``
versions of lag, with off-policy correction (``trainer.off_policy``). With staleness 0 both
produce the same tasks, sample ids, seeds, policy versions and weights.

Ctrl-C (:class:`~relax_agent.control.stop.StopRequest`) cancels the producers and their
episodes (envs closed), lets a trainer update in flight finish, and the loop saves the last
complete step. Resume restores weights, optimizer, step, policy version and the task sampler
exactly; with ``max_staleness = s > 0`` the up to ``s * B`` groups in flight at the save are
not replayed (no task is trained twice, a few are skipped).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_agent import metrics as M
from relax_agent import records as R
from relax_agent.checkpoint import CheckpointManager, load_state
from relax_agent.config import RelaxConfig, dump_config
from relax_agent.control.advantages import CONSUMER as ADVANTAGE_CONSUMER
from relax_agent.control.mismatch_watch import MismatchWatch
from relax_agent.control.pipeline import KEEPER, TRAINER, Run
from relax_agent.control.resume import check_resume_tasks
from relax_agent.control.stop import StopRequest
from relax_agent.errors import ConfigError
from relax_agent.evaluation import evaluate
from relax_agent.pools import split_pools
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.runtime.base import PARTITION, Runtime, TrainerService
from relax_agent.sampler import TaskSampler


class Controller:
    """Runs training (and evaluation) for one config over a runtime's services.

    Args:
        cfg: the validated run config.
        runtime: the rollout and trainer services (see :func:`relax_agent.runtime.local.build_local_runtime`).
        bus: the data bus the services write to (a :class:`~relax_agent.data.TransferQueue`).
        reporter: receives progress events (console bar); ``None`` for silence.
    """

    def __init__(self, cfg: RelaxConfig, runtime: Runtime, bus: Any, reporter: Any = None):
        self.cfg = cfg
        self.runtime = runtime
        self.bus = bus
        self.reporter = reporter
        self.out = Path(cfg.run.output_dir)
        self.logger = M.MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard)
        self.ckpts = CheckpointManager(self.out, cfg.checkpoint.keep_last,
                                       frozenset({0}) if cfg.checkpoint.keep_warmup else frozenset())
        self.pools = split_pools(runtime.train_tasks, runtime.heldout_tasks, cfg.env.warmup_fraction,
                                 cfg.env.near_duplicate_jaccard)
        """The warm-up's and RL's task pools (``env.warmup_fraction``, ``env.near_duplicate_jaccard``)."""
        self.sampler = TaskSampler(len(self.pools.rl), cfg.run.seed)
        """Task order at the last step boundary (what a checkpoint saves)."""
        self.step = 0
        self.version = 0
        self.groups_drawn = 0
        """Groups drawn by the last complete step (names and seeds the next ones)."""
        self.stop = StopRequest()
        self.B, self.G = cfg.rollout.tasks_per_step, cfg.rollout.group_size
        self.s = cfg.max_staleness if cfg.mode == "async" else 0
        self.weights_dirty = False
        """True while an update has changed the trainer's weights but its step is not complete
        (a checkpoint then would not match any step)."""
        self.sft_done = cfg.trainer.sft_warmup_steps == 0
        """The supervised warm-up ran (or none is configured)."""
        self.mismatch = MismatchWatch()
        """Flags a jump in the rollout-vs-trainer log-prob mismatch on each step's row."""

    def close(self) -> None:
        """Close the runtime's services and the bus."""
        self.runtime.close()

    @property
    def trainer(self) -> TrainerService:
        """The runtime's trainer service; RuntimeError for a runtime built to evaluate only."""
        if self.runtime.trainer is None:
            raise RuntimeError("this runtime has no trainer service (it was built to evaluate only)")
        return self.runtime.trainer

    # -- resume -----------------------------------------------------------------------------
    def restore(self, ckpt: Path) -> None:
        """Continue from ``ckpt`` (the policy was already loaded from ``ckpt/model``); its
        weights are published to the engines as the checkpoint's policy version."""
        check_resume_tasks(ckpt, len(self.pools.rl), self.cfg)
        state, trainer_state = load_state(ckpt)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.version = state["step"], state["policy_version"]
        self.groups_drawn = state.get("groups_drawn", self.step * self.B)
        self.sft_done = state.get("sft_done", True)
        self.trainer.restore(trainer_state, self.version)
        self.logger.supersede_after(self.step)

    def save(self) -> Path:
        """Checkpoint the last complete step."""
        state = {"policy_version": self.version, "sampler": self.sampler.state_dict(), "groups_drawn": self.groups_drawn,
                 "sft_done": self.sft_done}
        trainer = self.trainer
        return self.ckpts.save(self.step, trainer.save_model, trainer.state_dict(), state, dump_config(self.cfg))

    # -- the run ----------------------------------------------------------------------------
    def params(self, temperature: float | None = None) -> SamplingParams:
        """Sampling parameters of ``rollout`` (``temperature`` overrides the configured one when given)."""
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, temperature or r.temperature, r.top_p)

    def train(self) -> dict[str, Any]:
        """Run until ``trainer.steps``; returns the last step's metrics and eval results."""
        summary: dict[str, Any] = self._earlier_evals()
        with self.stop:
            try:
                if self.cfg.eval.at_start and self.step == 0 and self.version == 0:
                    summary["eval_start"] = self.run_eval()
                if not self.sft_done:
                    summary["sft"] = self.sft_warmup()
                    if self.cfg.checkpoint.keep_warmup:
                        summary["checkpoint_warmup"] = str(self.save())
                    if self.cfg.eval.after_warmup:
                        summary["eval_warmup"] = self.run_eval(name="warmup")
                if self.step < self.cfg.trainer.steps:
                    summary.update(self._pipeline())
                if self.cfg.eval.at_end:
                    summary["eval_end"] = self.run_eval()
            except KeyboardInterrupt:
                summary["interrupted"] = True
            finally:
                summary["checkpoint"] = self._final_checkpoint()
                summary["plot"] = str(self.plot()) if self.cfg.logging.plot else None
                self.logger.close()
        return summary

    def _earlier_evals(self) -> dict[str, Any]:
        """A resumed run's evaluations before its checkpoint (at start, after the warm-up), read back from
        ``eval/`` so its summary holds them too; ``{}`` for a fresh run."""
        if self.step == 0 and self.version == 0 and not (self.sft_done and self.cfg.trainer.sft_warmup_steps):
            return {}
        found = {}
        for key, stem in (("eval_start", "step_000000"), ("eval_warmup", "warmup")):
            path = self.out / "eval" / f"{stem}.json"
            if path.is_file():
                found[key] = json.loads(path.read_text())
        return found

    def _final_checkpoint(self) -> str | None:
        if not self.cfg.trainer.steps or self.weights_dirty:
            # no RL step configured (the warm-up's checkpoint, if any, is the run's), or an update
            # failed half-way (the trainer's weights match no step): the newest checkpoint there is
            latest = self.ckpts.latest()
            return None if latest is None else str(latest)
        return str(self.save())

    def _pipeline(self) -> dict[str, Any]:
        """Create the partition, run producers, the advantage consumer and the trainer until
        ``trainer.steps``; returns ``{"last": last step's metrics}``."""
        from relax_agent.data import queue_capacity

        routes = self.runtime.rollout.routes
        capacity, consumers = queue_capacity(self.B, self.s, self.G), [ADVANTAGE_CONSUMER, TRAINER]
        if self.trainer.rows_needed_after() is not None:
            # the rows of up to checkpoint.every_steps updates wait on the bus for a checkpoint
            capacity += self.cfg.checkpoint.every_steps * self.B * self.G
            consumers.append(KEEPER)
        self.bus.create_partition(PARTITION, capacity, R.rollout_schema(*(routes or ())), group_size=self.G,
                                  retire_after=consumers)
        run = Run(self)
        try:
            self.stop.run(run.main)
        finally:
            run.close()
        return {"last": run.last_row} if run.last_row else {}

    def sft_warmup(self) -> dict[str, float]:
        """The supervised warm-up (``trainer.sft_warmup_steps`` updates on the env's demonstrations
        of the warm-up pool (the train split, or its ``env.warmup_fraction`` share), ``trainer.sft_batch_size`` each, in a seeded order that cycles epoch by
        epoch); its weights are published as the next policy version. Progress goes to
        ``sft.jsonl``; returns the first and last loss. Ctrl-C stops it between updates (nothing
        is checkpointed: the warm-up starts again on resume); a finished warm-up is saved as
        ``checkpoints/step_000000`` (``checkpoint.keep_warmup``)."""
        import json

        import numpy as np

        t = self.cfg.trainer
        if not self.pools.warmup:
            raise ConfigError(f"env.warmup_fraction={self.cfg.env.warmup_fraction} leaves the warm-up pool empty "
                              f"({len(self.pools.rl)} train tasks in RL's pool); raise it or set trainer.sft_warmup_steps=0")
        demos = self.runtime.rollout.demonstrations(self.pools.warmup, self.cfg.run.seed)
        n = len(demos["task_id"])
        rng = np.random.default_rng(self.cfg.run.seed)
        order: list[int] = []
        while len(order) < t.sft_warmup_steps * t.sft_batch_size:
            order += rng.permutation(n).tolist()
        self._report("sft_start", {"total": t.sft_warmup_steps})
        losses = []
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "sft.jsonl").open("w") as log:
            for k in range(t.sft_warmup_steps):
                idx = order[k * t.sft_batch_size:(k + 1) * t.sft_batch_size]
                rows = {name: [demos[name][i] for i in idx]
                        for name in (R.TOKEN_IDS, R.LOSS_MASK, R.ROLLOUT_LOGPROBS, R.MEDIA) if name in demos}
                self.weights_dirty = True
                metrics = self.trainer.sft(rows, t.sft_lr)
                losses.append(metrics["sft/loss"])
                log.write(json.dumps({"sft/step": k + 1, **metrics}) + "\n")
                log.flush()
                self._report("sft", {"step": k + 1, "total": t.sft_warmup_steps, **metrics})
                self.stop.check()
        self.version += 1
        self.trainer.end_sft(self.version)
        self.weights_dirty = False
        self.sft_done = True
        out = {"sft/steps": float(t.sft_warmup_steps), "sft/demonstrations": float(n),
               "sft/loss_first": losses[0], "sft/loss_last": losses[-1], "policy_version": self.version}
        self.logger.log(self.step, out)
        return out

    # -- evaluation and plots ---------------------------------------------------------------
    def run_eval(self, run: Callable[[Callable[[], Any]], Any] | None = None, name: str | None = None) -> dict[str, Any]:
        """Evaluate on the held-out tasks; ``run`` drives the coroutines (default: Ctrl-C cancels them).

        Every sample goes to ``eval/step_NNNNNN.samples.jsonl`` in the run folder (task, prompt,
        response, parsed calls, verdict with reason; see :func:`relax_agent.evaluation.sample_record`),
        the result to ``eval/step_NNNNNN.json`` (a resumed run's summary takes its start and warm-up
        evaluations from there).
        ``name`` (e.g. "warmup") evaluates off the step cadence: the samples go to
        ``eval/<name>.samples.jsonl`` and the metrics row's ``eval/*`` keys become ``eval_<name>/*``,
        so it supersedes no step's evaluation.
        """
        e = self.cfg.eval
        tasks = self.runtime.heldout_tasks[: e.num_tasks]
        self._report("eval_start", {"total": len(tasks) * len(e.seeds)})
        stem = name or f"step_{self.step:06d}"
        result = evaluate(self.runtime.rollout, tasks, e.seeds, self.params(e.temperature),
                          on_done=lambda t: self._report("episode", {}), run=run or self.stop.run,
                          samples_path=self.out / "eval" / f"{stem}.samples.jsonl")
        (self.out / "eval").mkdir(parents=True, exist_ok=True)
        (self.out / "eval" / f"{stem}.json").write_text(json.dumps(result, default=float) + "\n")
        row = {k: v for k, v in result.items() if not isinstance(v, list)}
        if name:
            row = {k.replace("eval/", f"eval_{name}/", 1): v for k, v in row.items()}
        self.logger.log(self.step, row)
        self._report("eval", result)
        return result

    def plot(self) -> Path:
        """Draw the run's curves from ``metrics.jsonl`` to ``plots/curves.png``; returns that path."""
        return M.plot_curves(self.logger.path, self.out / "plots" / "curves.png")

    def _report(self, event: str, data: dict[str, Any]) -> None:
        if self.reporter is not None:
            self.reporter(event, self.step, data)

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0
