"""``relax-agent envs``: the registered environments, and one's tools, tasks and reward (with the
tool-call format a given policy gets for them)."""

from __future__ import annotations

import json

import typer

from relax_agent.commands.common import fail
from relax_agent.errors import ConfigError, RelaxError

envs_app = typer.Typer(help="Registered environments.", no_args_is_help=True)


@envs_app.command("list")
def envs_list(
    bridge: str | None = typer.Option(None, "--bridge", help="Only what one bridge's package offers, in full "
                                      "(verifiers, openenv, gem, textarena, reasoning_gym, harbor)."),
) -> None:
    """Registered environments (relax-agent's and installed plugin packages'), then what each bridge's
    installed package offers as ``env.id: "<scheme>:<name>"``."""
    from relax_agent.envs import env_ids
    from relax_agent.envs.bridges import BRIDGES

    if bridge is not None:
        if bridge not in BRIDGES:
            fail(ConfigError(f"--bridge {bridge!r}: expected one of {sorted(BRIDGES)}"))
            return
        for line in _bridge_lines(bridge, limit=None):
            typer.echo(line)
        return
    for env_id in env_ids():
        typer.echo(env_id)
    typer.echo("")
    typer.echo("bridges (env.id: \"<scheme>:<name>\"; all names: relax-agent envs list --bridge SCHEME):")
    for scheme in BRIDGES:
        typer.echo("  " + _bridge_lines(scheme, limit=4)[0])


def _bridge_lines(scheme: str, limit: int | None) -> list[str]:
    """One summary line for ``scheme`` (``limit`` names shown), or every name it offers (``limit=None``)."""
    from relax_agent.envs.bridges import BRIDGES, offered

    try:
        names = offered(scheme)
    except ConfigError:
        return [f"{scheme}: not installed: pip install 'relax-agent[{BRIDGES[scheme].extra}]'"]
    if limit is None:
        return [f"{scheme}:{name}" for name in names] or [f"{scheme}: (none installed)"]
    shown = ", ".join(f"{scheme}:{n}" for n in names[:limit])
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return [f"{scheme}: {shown}{more}" if names else f"{scheme}: (none installed)"]


@envs_app.command("show")
def envs_show(
    env_id: str = typer.Argument(..., help="Environment id, e.g. relax/Calculator-v0 (or module:ns/Name-v0)."),
    kwargs: str = typer.Option("{}", "--kwargs", help='Constructor kwargs as JSON, e.g. \'{"difficulty": 3}\'.'),
    as_json: bool = typer.Option(False, "--json", help="Print the description as JSON."),
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
        fail(exc)
        return
    except (gymnasium.error.Error, json.JSONDecodeError, ImportError, TypeError) as exc:
        fail(ConfigError(f"{env_id}: {exc}"))
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


@envs_app.command("audit")
def envs_audit(
    env_id: str = typer.Argument(..., help="Environment: a registered id, module:ns/Name-v0, or <scheme>:<name>."),
    kwargs: str = typer.Option("{}", "--kwargs", help='Constructor kwargs as JSON, e.g. \'{"difficulty": 3}\'.'),
    episodes: int = typer.Option(8, "--episodes", help="Held-out tasks each policy plays."),
    threshold: float = typer.Option(0.1, "--threshold", help="FAIL when a policy's mean reward (scaled to the "
                                    "reward range) is above this."),
    max_turns: int = typer.Option(8, "--max-turns", help="Replies per episode at most."),
    tool_parser: str = typer.Option("hermes", "--tool-parser", help="rollout.tool_parser that reads the replies."),
    success: float | None = typer.Option(None, "--success", help="Reward counted as solved (default: top of the range)."),
    reward_range: str | None = typer.Option(None, "--reward-range", help="LO,HI of the env's reward (default: the "
                                            "env's reward_range attribute, else 0,1)."),
    seed: int = typer.Option(0, "--seed", help="Picks the tasks; episode i resets with seed+i."),
    policy: list[str] | None = typer.Option(None, "--policy", help="Only these policies (repeatable; 'guess:' "
                                            "selects a family)."),
    step_timeout: float = typer.Option(60.0, "--step-timeout", help="Seconds one env call may take."),
    fail_on_errors: bool = typer.Option(False, "--fail-on-errors", help="FAIL also when the env raises."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    out: str | None = typer.Option(None, "--out", help="Write DIR/audit.json and DIR/README.md."),
) -> None:
    """Play degenerate policies (empty reply, echo, junk, garbage tool calls, uninformed guesses,
    success words) against an env with no model; FAIL (exit 1) when one earns reward. Exit 2: the
    audit could not run (or the env raised in every episode)."""
    import shlex
    import sys

    import gymnasium

    from relax_agent.commands.common import console
    from relax_agent.envaudit import audit, dumps, parse_reward_range, verdict_line, write_record

    try:
        report = audit(env_id, json.loads(kwargs), episodes=episodes, threshold=threshold, max_turns=max_turns,
                       tool_parser=tool_parser, success=success, seed=seed, step_timeout_s=step_timeout,
                       reward_range=parse_reward_range(reward_range) if reward_range else None, policies=policy,
                       fail_on_errors=fail_on_errors, progress=None if as_json else lambda line: console.print(
                           f"  {line}", markup=False, highlight=False))
    except (RelaxError, gymnasium.error.Error, json.JSONDecodeError, ImportError, TypeError, OSError) as exc:
        fail(ConfigError(f"envs audit {env_id}: {type(exc).__name__}: {exc}"))
        return
    if out is not None:
        command = shlex.join(["relax-agent", "envs", "audit", *sys.argv[sys.argv.index("audit") + 1:]]
                             if "audit" in sys.argv else ["relax-agent", "envs", "audit", env_id])
        for path in write_record(report, out, command):
            console.print(f"wrote {path}", markup=False, highlight=False)
    if as_json:
        typer.echo(dumps(report.to_dict()))
    else:
        _print_audit(report)
        typer.echo(verdict_line(report))
    if report.verdict != "PASS":
        raise typer.Exit(2 if report.verdict == "ERROR" else 1)


def _print_audit(report: object) -> None:
    """The audit's per-policy table on stdout (rich; 120 columns when stdout is not a terminal)."""
    import sys

    from rich.console import Console
    from rich.table import Table

    from relax_agent.envaudit import TABLE_HEADER, AuditReport, table_rows

    assert isinstance(report, AuditReport)
    table = Table(title=f"audit of {report.env}", title_justify="left")
    for name in TABLE_HEADER:
        table.add_column(name, justify="right" if name in ("episodes", "mean", "max", "solved", "turns") else "left",
                         no_wrap=name == "policy")
    for row in table_rows(report):
        table.add_row(*row, style="bold red" if row[-1] else None)
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    for note in report.notes:
        typer.echo(f"note: {note}")
