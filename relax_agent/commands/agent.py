"""``relax-agent agent check``: an agent program (or a config's ``rollout.agent.command``) run against a
scripted policy, and what it does that training cannot use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from relax_agent.commands.common import OVERRIDES, fail, load
from relax_agent.errors import ConfigError, RelaxError

agent_app = typer.Typer(help="Bring your own agent (rollout.driver: agent).", no_args_is_help=True)


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
        fail(exc)
        return
    typer.echo(format_rows(rows))
    failed = [r.name for r in rows if r.status == "fail"]
    typer.echo(f"{len(rows) - len(failed)}/{len(rows)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if failed:
        raise typer.Exit(1)


def _check_setup(target: Path, overrides: list[str] | None, num_tasks: int, model: str) -> tuple[Any, Any, Any, Any]:
    """(rollout.agent config, tasks, renderer, parser) of ``relax-agent agent check``."""
    from relax_agent.config import AgentConfig, ModelConfig
    from relax_agent.envs import HasTasks
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.proxy.check import CHECK_TASK, CheckTask

    if target.suffix in (".yaml", ".yml"):
        from relax_agent.roles import make_env_factory

        cfg = load(target, overrides)
        if not cfg.rollout.agent.command:
            raise ConfigError(f"{target}: rollout.agent.command is empty; nothing to check")
        r = cfg.rollout
        renderer = ChatRenderer(load_tokenizer(cfg.model), r.tools_in, r.system_prompt, r.tool_example)
        make_env = make_env_factory(cfg)
        inner = make_env().unwrapped
        pool = list(inner.tasks("train"))[:num_tasks] if isinstance(inner, HasTasks) else []
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
