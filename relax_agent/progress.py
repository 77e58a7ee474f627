"""Console progress for long runs (rich): a step bar, an episode bar, one line per step."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from relax_agent import metrics as M


def format_step(step: int, row: dict[str, Any]) -> str:
    """One human line for a training step: rewards, speed, the loss (or why nothing was trained)
    and, when any episode failed, how many of the step's episodes did; a jump in the rollout-vs-trainer
    log-prob mismatch is named (see :mod:`relax_agent.control.mismatch_watch`)."""
    failed, episodes = row.get("rollout/failed", 0.0), row.get("rollout/episodes", 0.0)
    return (
        f"step {step:>4}  reward {row.get(M.REWARD, 0):.3f}  acc {row.get(M.ACCURACY, 0):.3f}  "
        f"format {row.get(M.FORMAT_RATE, 0):.3f}  {row.get(M.TOKENS_PER_S, 0):.0f} tok/s  "
        f"{_update_text(row, failed, episodes)}  {row.get(M.STEP_TIME, 0):.1f} s"
        + (f"  failed {failed:.0f}/{episodes:.0f} episodes" if failed > 0 else "")
        + _filtered_text(row)
        + ("  log-prob mismatch jumped (mismatch/alarm)" if row.get("mismatch/alarm") else "")
    )


def _filtered_text(row: dict[str, Any]) -> str:
    filtered = row.get("dynamic_sampling/filtered_groups")
    if filtered is None:
        return ""
    cap = "  (draw cap reached: uniform groups kept)" if row.get("dynamic_sampling/cap_reached") else ""
    return f"  filtered {filtered:.0f} uniform groups{cap}"


def _update_text(row: dict[str, Any], failed: float, episodes: float) -> str:
    if "train/loss" in row:
        return f"loss {row['train/loss']:.4f}"
    if episodes > 0 and failed >= episodes:
        return "no update (every episode failed)"
    return "no update (all groups uniform)"


def format_eval(result: dict[str, Any]) -> str:
    """One human line for an evaluation: means ± std over seeds, and failed episodes when any."""
    failed = result.get("eval/failed", 0.0)
    return (
        f"eval ({result['eval/num_tasks']} held-out tasks x {len(result['eval/seeds'])} seeds): "
        f"accuracy {result['eval/accuracy']:.3f} ± {result['eval/accuracy_std']:.3f}  "
        f"well-formed {result['eval/well_formed']:.3f} ± {result['eval/well_formed_std']:.3f}  "
        f"reward {result['eval/reward']:.3f}"
        + (f"  failed {failed:g}/{result['eval/num_tasks']} episodes per seed" if failed > 0 else "")
    )


class ConsoleReporter:
    """Receives controller events and draws them; use as a context manager."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None):
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.steps = self.progress.add_task("steps", total=total_steps, completed=start_step)
        self.episodes = self.progress.add_task("episodes", total=1, visible=False)

    def __enter__(self) -> ConsoleReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def __call__(self, event: str, step: int, data: dict[str, Any]) -> None:
        """Draw one controller ``event`` of ``step``: progress bars for rollout, evaluation and SFT
        warm-up episodes, a printed line for each finished step or evaluation."""
        if event in ("rollout_start", "eval_start"):
            label = "rollout" if event == "rollout_start" else "eval"
            self.progress.reset(self.episodes, total=data["total"], description=f"  {label} episodes", visible=True)
        elif event == "episode":
            self.progress.advance(self.episodes)
        elif event == "step":
            self.progress.update(self.steps, completed=step)
            self.progress.console.print(format_step(step, data))
        elif event == "eval":
            self.progress.console.print(format_eval(data))
        elif event == "sft_start":
            self.progress.reset(self.episodes, total=data["total"], description="  sft warm-up", visible=True)
        elif event == "sft":
            self.progress.advance(self.episodes)
            if data["step"] == data["total"] or data["step"] % 10 == 0:
                self.progress.console.print(f"sft {data['step']}/{data['total']}: loss {data['sft/loss']:.3f}")
