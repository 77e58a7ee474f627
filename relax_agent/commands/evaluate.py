"""``relax-agent eval`` (held-out accuracy of a checkpoint, every sample written) and ``relax-agent
replay`` (a trained step's token record checked episode by episode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from relax_agent.commands.common import OVERRIDES, announce, console, fail, load, write_summary
from relax_agent.errors import RelaxError


def eval_cmd(
    config: Path = typer.Argument(..., help="YAML run config."),
    overrides: list[str] | None = OVERRIDES,
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Checkpoint or run folder; default: the untrained policy."),
    output: Path | None = typer.Option(None, "--output", help="Write the results as JSON here."),
    bfcl: bool = typer.Option(False, "--bfcl",
                              help="Evaluate every registered BFCL category (eval.num_tasks held-out tasks each) "
                                   "and report the leaderboard's groups."),
) -> None:
    """Report held-out accuracy of a checkpoint (or of the untrained policy).

    Every sample (task id, prompt, response, parsed calls, verdict with reason) is written as JSON
    lines beside the summary: ``<output stem>.samples.jsonl`` (``--bfcl``: a folder
    ``<output stem>.samples/`` with one file per category), or under ``run.output_dir`` without
    ``--output``; the most common failure reasons are printed.
    """
    from relax_agent.checkpoint import resolve
    from relax_agent.evaluation import evaluate, evaluate_bfcl, format_bfcl, format_failure_table
    from relax_agent.progress import format_eval
    from relax_agent.roles import build_roles
    from relax_agent.rollout.engines.base import SamplingParams

    try:
        cfg = load(config, overrides)
        model_path = resolve(checkpoint) / "model" if checkpoint else None
        base = output.with_suffix("") if output else Path(cfg.run.output_dir) / "eval"
        roles = build_roles(cfg, model_path=model_path, train=False, on_load=announce)
        e, r = cfg.eval, cfg.rollout
        params = SamplingParams(r.max_new_tokens, e.temperature, r.top_p)
        if bfcl:
            def report(category: str, res: dict[str, Any]) -> None:
                console.print(f"{category}: accuracy {res['eval/accuracy']:.3f} ({res['eval/num_tasks']} tasks)")

            result = evaluate_bfcl(roles.runner, e.num_tasks, e.seeds, params, env_kwargs=cfg.env.kwargs,
                                   samples_dir=Path(f"{base}.samples"), on_category=report)
        else:
            result = evaluate(roles.runner, roles.heldout_tasks[: e.num_tasks], e.seeds, params,
                              samples_path=Path(f"{base}.samples.jsonl"))
        roles.close()
    except RelaxError as exc:
        fail(exc)
        return
    result["checkpoint"] = str(model_path.parent) if model_path else None
    if bfcl:
        console.print(format_bfcl(result), markup=False, highlight=False)
        for category, res in result["categories"].items():
            n = res["eval/num_tasks"] * len(res["eval/seeds"])
            console.print(f"{category}: " + format_failure_table(res["eval/failure_reasons"][:3], n),
                          markup=False, highlight=False)
        console.print(f"samples: {base}.samples/")
    else:
        console.print(format_eval(result))
        n = result["eval/num_tasks"] * len(result["eval/seeds"])
        console.print(format_failure_table(result["eval/failure_reasons"], n), markup=False, highlight=False)
        console.print(f"samples: {result['eval/samples_path']}")
    if output:
        write_summary(output, result)
    typer.echo(json.dumps({k: v for k, v in result.items()}, default=str))


def replay(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    overrides: list[str] | None = OVERRIDES,
    step: int = typer.Option(..., "--step", help="Training step to replay (its token record must exist)."),
    run_dir: Path | None = typer.Option(None, "--run", help="Run folder; default: run.output_dir."),
    logprobs: bool = typer.Option(True, "--logprobs/--no-logprobs", help="Recompute log-probs with the weights of each sample's version."),
    atol: float = typer.Option(2e-3, "--atol", help="Largest |recomputed - recorded| log-prob accepted."),
) -> None:
    """Replay a trained step: find, per episode, the first token where the record diverges.

    Checks the turns' placement, the loss mask, each observation delta (re-rendered with the chat
    template; media episodes: with their media processed again, each item compared with the record)
    and, with the checkpoint of the version that sampled it, the rollout log-probs. Env-driven,
    agent-driven and media episodes alike.
    Exit code 1 when any episode diverges.
    """
    from relax_agent.replay import replay_step

    try:
        cfg = load(config, overrides)
        run = run_dir or Path(cfg.run.output_dir)
        reports = replay_step(cfg, run, step, logprobs=logprobs, atol=atol)
    except RelaxError as exc:
        fail(exc)
        return
    from relax_agent.models import load_tokenizer

    decode = load_tokenizer(cfg.model).decode
    bad = 0
    for rep in reports:
        if rep.divergence is not None:
            bad += 1
            line = "DIVERGED " + rep.divergence.describe(decode)
        else:
            line = "ok" + (f" (max |log-prob diff| {rep.max_logprob_diff:.2e})" if rep.max_logprob_diff is not None else "")
        skipped = "; ".join(f"{k} skipped: {v}" for k, v in rep.skipped.items())
        typer.echo(f"{rep.sample_id}  v{rep.sample_version}  {rep.turns} turn(s)  {line}" + (f"  [{skipped}]" if skipped else ""))
    typer.echo(f"step {step}: {len(reports) - bad} of {len(reports)} episodes replay without divergence")
    if bad:
        raise typer.Exit(1)
