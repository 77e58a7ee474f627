"""``relax-agent train`` (a run from its config, or resumed from its latest checkpoint) and
``relax-agent scale`` (the rollout replicas of a running ``runtime: ray`` training)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from relax_agent.commands.common import (
    OVERRIDES,
    announce,
    console,
    fail,
    load,
    null,
    resume_command,
    write_summary,
)
from relax_agent.errors import ConfigError, RelaxError, RuntimeServiceError, WeightSyncError


def _checkpoint_to_resume(cfg: Any, resume: bool) -> Path | None:
    from relax_agent.checkpoint import CheckpointManager

    latest = CheckpointManager(cfg.run.output_dir).latest()
    if resume and latest is None:
        console.print(f"[yellow]--resume: no checkpoint in {cfg.run.output_dir}; starting from step 0[/]")
    if not resume and latest is not None:
        raise ConfigError(
            f"run.output_dir={cfg.run.output_dir!r} already holds checkpoints (latest {latest.name}); "
            "pass --resume to continue it or set run.output_dir to a new folder"
        )
    return latest if resume else None


def train(
    config: Path = typer.Argument(..., help="YAML run config (see examples/)."),
    overrides: list[str] | None = OVERRIDES,
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in run.output_dir."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
) -> None:
    """Train a policy with GRPO on a registered environment."""
    from relax_agent.control import build_controller
    from relax_agent.progress import ConsoleReporter, format_eval
    from relax_agent.roles import build_run_roles

    try:
        cfg = load(config, overrides)
        ckpt = _checkpoint_to_resume(cfg, resume)
        roles = build_run_roles(cfg, model_path=None if ckpt is None else ckpt / "model", on_load=announce,
                            on_tasks=None if ckpt is None else _check_resume(ckpt, cfg))
        controller = build_controller(cfg, roles)
        try:
            if ckpt is not None:
                controller.restore(ckpt)
                console.print(f"resumed from {ckpt} at step {controller.step}")
            show = cfg.logging.progress and not quiet
            with ConsoleReporter(cfg.trainer.steps, controller.step, console) if show else null() as reporter:
                controller.reporter = reporter
                summary = controller.train()
        finally:
            controller.close()
    except (RuntimeServiceError, WeightSyncError) as exc:  # a role died or hung past its restarts; a version
        fail(exc, resume=resume_command(config, overrides))  # refused past weights.publish_retries
        return
    except RelaxError as exc:
        fail(exc)
        return
    write_summary(Path(cfg.run.output_dir) / "summary.json", summary)
    for key in ("eval_start", "eval_warmup", "eval_end"):
        if key in summary:
            console.print(f"{key.replace('_', ' ')}: {format_eval(summary[key])}")
    console.print(f"checkpoint: {summary['checkpoint']}")
    if summary.get("plot"):
        console.print(f"plot: {summary['plot']}")
    if summary.get("interrupted"):
        console.print("[yellow]interrupted: saved; continue with --resume[/]")
        raise typer.Exit(130)


def _check_resume(ckpt: Path, cfg: Any) -> Any:
    """Warn now about config keys changed since ``ckpt``; returns the ``on_tasks`` check that the
    checkpoint's train split matches this run's (run before the policy loads)."""
    from relax_agent.control.resume import check_resume_tasks, format_resume_changes, resume_changes

    changes = resume_changes(ckpt, cfg)
    if changes:
        console.print(format_resume_changes(ckpt, changes), style="yellow", markup=False, highlight=False)

    def on_tasks(train_tasks: list[Any], heldout_tasks: list[Any]) -> None:
        from relax_agent.pools import split_pools

        rl = split_pools(train_tasks, heldout_tasks, cfg.env.warmup_fraction, cfg.env.near_duplicate_jaccard).rl
        check_resume_tasks(ckpt, len(rl), cfg)

    return on_tasks


def scale(
    run_dir: Path = typer.Argument(..., help="run.output_dir of a running training with runtime.kind=ray."),
    rollout: int = typer.Option(..., "--rollout", help="Rollout replicas to run from now on (>= 1)."),
) -> None:
    """Scale the rollout replicas of a running ``runtime: ray`` training (new ones pull the latest
    weights before they serve; removed ones finish or hand back their groups first)."""
    from relax_agent.runtime.ray_control import scale_run

    try:
        status = scale_run(run_dir, rollout)
    except RelaxError as exc:
        fail(exc)
        return
    states = ", ".join(f"{r['name']} {r['state']}" for r in status["replicas"])
    console.print(f"rollout replicas: target {status['target']} ({states})")
    typer.echo(json.dumps(status))
