"""The ``relax-agent`` command: wires config to the controller, nothing more."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from relax_agent.errors import ConfigError, RelaxError, RuntimeServiceError

app = typer.Typer(
    name="relax-agent",
    help="Asynchronous RL post-training for agentic, tool-using language models.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
envs_app = typer.Typer(help="Registered environments.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")
agent_app = typer.Typer(help="Bring your own agent (rollout.driver: agent).", no_args_is_help=True)
app.add_typer(agent_app, name="agent")
console = Console(stderr=True, soft_wrap=True)

OVERRIDES = typer.Argument(None, help="Dotted overrides of the config, e.g. rollout.group_size=4 eval.num_tasks=100")


def _version(value: bool) -> None:
    if value:
        from relax_agent import __version__

        typer.echo(f"relax-agent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Asynchronous RL post-training for agentic, tool-using language models."""


def _fail(exc: RelaxError, resume: str | None = None) -> None:
    """One ``error:`` line: the root cause (an error raised inside a Ray actor without Ray's wrapper
    header), then ``resume`` (the command that continues the run) when given; exit 2 for a config
    error, else 1."""
    text = str(_unwrapped(exc))
    if resume is not None:
        text = f"{text}; resume from the last checkpoint with: {resume}"
    console.print("[bold red]error:[/] ", end="")
    console.print(text, markup=False, highlight=False)
    raise typer.Exit(2 if isinstance(exc, ConfigError) else 1)


def _unwrapped(exc: BaseException) -> BaseException:
    """The exception raised inside a Ray actor, when ``exc`` is Ray's ``RayTaskError`` around it."""
    for _ in range(16):
        cause = getattr(exc, "cause", None)
        if not type(exc).__name__.startswith("RayTaskError") or not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def _resume_command(config: Path, overrides: list[str] | None) -> str:
    """``relax-agent train CONFIG OVERRIDES... --resume``, quoted for a shell."""
    return shlex.join(["relax-agent", "train", str(config), *(overrides or []), "--resume"])


def _load(config: Path, overrides: list[str] | None) -> Any:
    from relax_agent.config import load_config
    from relax_agent.preflight import preflight

    cfg = load_config(config, list(overrides or []))
    preflight(cfg)
    return cfg


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


@app.command()
def train(
    config: Path = typer.Argument(..., help="YAML run config (see examples/)."),
    overrides: list[str] | None = OVERRIDES,
    resume: bool = typer.Option(False, "--resume", is_flag=True, help="Continue from the latest checkpoint in run.output_dir."),
    quiet: bool = typer.Option(False, "--quiet", is_flag=True, help="No progress bars."),
) -> None:
    """Train a policy with GRPO on a registered environment."""
    from relax_agent.control import build_controller
    from relax_agent.progress import ConsoleReporter, format_eval
    from relax_agent.roles import build_run_roles

    try:
        cfg = _load(config, overrides)
        ckpt = _checkpoint_to_resume(cfg, resume)
        roles = build_run_roles(cfg, model_path=None if ckpt is None else ckpt / "model", on_load=_announce,
                            on_tasks=None if ckpt is None else _check_resume(ckpt, cfg))
        controller = build_controller(cfg, roles)
        try:
            if ckpt is not None:
                controller.restore(ckpt)
                console.print(f"resumed from {ckpt} at step {controller.step}")
            show = cfg.logging.progress and not quiet
            with ConsoleReporter(cfg.trainer.steps, controller.step, console) if show else _null() as reporter:
                controller.reporter = reporter
                summary = controller.train()
        finally:
            controller.close()
    except RuntimeServiceError as exc:  # a role of a runtime: ray run died or hung past its restarts
        _fail(exc, resume=_resume_command(config, overrides))
        return
    except RelaxError as exc:
        _fail(exc)
        return
    _write_summary(Path(cfg.run.output_dir) / "summary.json", summary)
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
        check_resume_tasks(ckpt, len(train_tasks), cfg)

    return on_tasks


def _announce(path: str) -> None:
    console.print(f"loading policy {path} ...")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str))


@app.command("eval")
def eval_cmd(
    config: Path = typer.Argument(..., help="YAML run config."),
    overrides: list[str] | None = OVERRIDES,
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Checkpoint or run folder; default: the untrained policy."),
    output: Path | None = typer.Option(None, "--output", help="Write the results as JSON here."),
    bfcl: bool = typer.Option(False, "--bfcl", is_flag=True,
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
        cfg = _load(config, overrides)
        model_path = resolve(checkpoint) / "model" if checkpoint else None
        base = output.with_suffix("") if output else Path(cfg.run.output_dir) / "eval"
        roles = build_roles(cfg, model_path=model_path, train=False, on_load=_announce)
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
        _fail(exc)
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
        _write_summary(output, result)
    typer.echo(json.dumps({k: v for k, v in result.items()}, default=str))


@app.command()
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
        cfg = _load(config, overrides)
        run = run_dir or Path(cfg.run.output_dir)
        reports = replay_step(cfg, run, step, logprobs=logprobs, atol=atol)
    except RelaxError as exc:
        _fail(exc)
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


@app.command()
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
        _fail(exc)
        return
    states = ", ".join(f"{r['name']} {r['state']}" for r in status["replicas"])
    console.print(f"rollout replicas: target {status['target']} ({states})")
    typer.echo(json.dumps(status))


@app.command()
def view(
    run_dir: Path = typer.Argument(..., help="A run's run.output_dir (finished or still training)."),
    port: int = typer.Option(0, "--port", help="TCP port; 0 picks a free one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (keep it loopback unless you mean to share)."),
    tokenizer: str = typer.Option("auto", "--tokenizer",
                                  help="Tokenizer folder or hub id to show token ids as text; auto: the run's latest "
                                       "checkpoint's; none: ids only."),
) -> None:
    """Browse a run in a local web page: steps, groups, episodes, evaluation samples, curves."""
    from pydantic import ValidationError

    from relax_agent.netaddr import is_loopback
    from relax_agent.viewer import ViewerConfig, build

    try:
        try:
            server = build(ViewerConfig(run_dir=run_dir, host=host, port=port,
                                        tokenizer=None if tokenizer == "none" else tokenizer))
        except ValidationError as exc:
            raise ConfigError(f"view: --port={port}: expected 0..65535 ({exc.errors()[0]['msg']})") from None
    except RelaxError as exc:
        _fail(exc)
        return
    if not is_loopback(host):
        console.print(f"[yellow]--host {host} is not a loopback address: anyone who reaches it can read the run[/]")
    console.print(f"viewing {server.reader.dir}; Ctrl-C stops")
    typer.echo(server.url)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C before uvicorn installed its handler
        pass


@envs_app.command("list")
def envs_list() -> None:
    """Registered environments: relax-agent's and those of installed plugin packages."""
    from relax_agent.envs import env_ids

    for env_id in env_ids():
        typer.echo(env_id)


@envs_app.command("show")
def envs_show(
    env_id: str = typer.Argument(..., help="Environment id, e.g. relax/Calculator-v0 (or module:ns/Name-v0)."),
    kwargs: str = typer.Option("{}", "--kwargs", help='Constructor kwargs as JSON, e.g. \'{"difficulty": 3}\'.'),
    as_json: bool = typer.Option(False, "--json", is_flag=True, help="Print the description as JSON."),
    model: str | None = typer.Option(None, "--model", help="A policy (model.path): also print the tool-call parser "
                                        "and tools rendering it gets (its tokenizer only is loaded)."),
    tool_parser: str = typer.Option("auto", "--tool-parser", help="rollout.tool_parser to resolve for --model."),
    tools_in: str = typer.Option("auto", "--tools-in", help="rollout.tools_in for --model (auto, template, system)."),
) -> None:
    """Tool schemas, tasks per split and reward of one environment (and, with --model, the tool-call
    parser that ``rollout.tool_parser: auto`` chooses for that policy and how its tools are rendered)."""
    import gymnasium

    from relax_agent.envs import describe

    try:
        info = describe(env_id, **json.loads(kwargs))
        if model is not None:
            info["policy"] = _policy_tool_format(model, tool_parser, tools_in)
    except RelaxError as exc:
        _fail(exc)
        return
    except (gymnasium.error.Error, json.JSONDecodeError, ImportError, TypeError) as exc:
        _fail(ConfigError(f"{env_id}: {exc}"))
        return
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    typer.echo(f"{info['id']}  ({info['entry_point']}, max_episode_steps={info['max_episode_steps']})")
    typer.echo(f"kwargs: {json.dumps(info['kwargs'], default=str)}")
    if "tasks" in info:
        typer.echo("tasks: " + ", ".join(f"{k} {v}" for k, v in info["tasks"].items()))
    typer.echo(f"reward: {info['reward']}")
    tools = info.get("tools")
    typer.echo(f"tools: {info['tools_error']}" if tools is None else f"tools ({len(tools)}):")
    for tool in tools or []:
        fn = tool["function"]
        typer.echo(f"  {fn['name']}({', '.join(fn.get('parameters', {}).get('properties', {}))}): {fn.get('description', '')}")
    if "policy" in info:
        p = info["policy"]
        typer.echo(f"policy: {p['model']}")
        typer.echo(f"tool parser: {p['tool_parser']} ({p['why']})")
        typer.echo(f"tools in: {p['tools_in']}")


def _policy_tool_format(model: str, tool_parser: str, tools_in: str) -> dict[str, str]:
    """``{"model", "tool_parser", "why", "tools_in"}``: the parser ``tool_parser`` (``auto`` resolved as a
    run resolves it) and the tools rendering a policy's tokenizer gets.

    Raises:
        ConfigError: ``tools_in`` or ``tool_parser`` is not a known value, ``auto`` cannot tell the format,
            or the chat template lacks what token-in/token-out needs.
        ModelLoadError: the tokenizer cannot be loaded.
    """
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.tool_parsers import resolve_tool_parser

    if tools_in not in ("auto", "template", "system"):
        raise ConfigError(f"--tools-in={tools_in!r}: expected one of auto, template, system")
    tokenizer = load_tokenizer(ModelConfig(path=model))
    renderer = ChatRenderer(tokenizer, tools_in)
    if tool_parser == "auto":
        name, why = resolve_tool_parser(tokenizer, tools_in, None, model)
    else:
        build_parser(tool_parser)  # an unknown name is refused here
        name, why = tool_parser, "rollout.tool_parser"
    return {"model": model, "tool_parser": name, "why": why, "tools_in": renderer.describe_tools_in()}


@agent_app.command("check")
def agent_check(
    target: Path = typer.Argument(..., help="A config with rollout.agent.command (.yaml), or the agent program itself."),
    overrides: list[str] | None = OVERRIDES,
    tasks: int = typer.Option(2, "--tasks", min=1, help="Episodes to play (tasks of the config's env, or a built-in one)."),
    model: str = typer.Option("embedded:smollm2-135m-instruct", "--model",
                              help="Tokenizer (chat template) to use for a program; a config uses model.path."),
    timeout_s: float | None = typer.Option(None, "--timeout-s", help="Seconds per episode; default rollout.agent.timeout_s."),
) -> None:
    """Run an agent program against a scripted policy on 127.0.0.1 and print what it does that training
    cannot use (pass/warn/fail per check, with the fix); exits 1 when a check fails. Loads no weights."""
    import asyncio

    from relax_agent.rollout.proxy.check import check_agent, format_rows

    try:
        agent_cfg, run_tasks, renderer, parser = _check_setup(target, overrides, tasks, model)
        if timeout_s is not None:
            agent_cfg = agent_cfg.model_copy(update={"timeout_s": timeout_s})
        rows = asyncio.run(check_agent(agent_cfg, run_tasks, renderer, parser))
    except RelaxError as exc:
        _fail(exc)
        return
    typer.echo(format_rows(rows))
    failed = [r.name for r in rows if r.status == "fail"]
    typer.echo(f"{len(rows) - len(failed)}/{len(rows)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if failed:
        raise typer.Exit(1)


def _check_setup(target: Path, overrides: list[str] | None, num_tasks: int, model: str) -> tuple[Any, Any, Any, Any]:
    """(rollout.agent config, tasks, renderer, parser) of ``relax-agent agent check``."""
    from relax_agent.config import AgentConfig, ModelConfig
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.proxy.check import CHECK_TASK, CheckTask

    if target.suffix in (".yaml", ".yml"):
        from relax_agent.roles import make_env_factory

        cfg = _load(target, overrides)
        if not cfg.rollout.agent.command:
            raise ConfigError(f"{target}: rollout.agent.command is empty; nothing to check")
        r = cfg.rollout
        renderer = ChatRenderer(load_tokenizer(cfg.model), r.tools_in, r.system_prompt, r.tool_example)
        make_env = make_env_factory(cfg)
        listed = getattr(make_env().unwrapped, "tasks", None)
        pool = list(listed("train"))[:num_tasks] if callable(listed) else []
        run_tasks = []
        for k in range(num_tasks):
            env = make_env()
            task = pool[k % len(pool)] if pool else None
            obs, info = env.reset(seed=k, options={"task": task} if task is not None else None)

            def score(message: dict[str, Any], env: Any = env) -> float:
                return float(env.step(message)[1])

            run_tasks.append(CheckTask(str((task or {}).get("id", f"task-{k}")), tuple(obs), tuple(info.get("tools") or ()),
                                       dict(task or {}), score))
        from relax_agent.roles import resolved_parser_name

        return cfg.rollout.agent, run_tasks, renderer, build_parser(resolved_parser_name(cfg, renderer.tokenizer,
                                                                                        cfg.model.path))
    if not target.exists():
        raise ConfigError(f"{target}: no such agent program or config")
    command = ["{python}", str(target)] if target.suffix == ".py" else [str(target.resolve())]
    task = CheckTask(CHECK_TASK["id"], tuple(CHECK_TASK["messages"]), tuple(CHECK_TASK["tools"]), CHECK_TASK["metadata"])
    renderer = ChatRenderer(load_tokenizer(ModelConfig(path=model)))
    return AgentConfig(command=command, timeout_s=60.0), [task] * num_tasks, renderer, build_parser("hermes")


def _add_subcommands() -> None:
    from relax_agent.sandboxes.cli import app as sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="Build sandbox images and reap leaked sandboxes.")
    from relax_agent.reward_services.cli import serve_reward

    app.command("serve-reward")(serve_reward)


def main() -> None:
    """Entry point of the ``relax-agent`` console script."""
    try:
        _add_subcommands()
    except ImportError as exc:  # a plugin package failed to import: the core commands still work
        print(f"warning: some subcommands are unavailable: {exc}", file=sys.stderr)
    app()


if __name__ == "__main__":
    main()
