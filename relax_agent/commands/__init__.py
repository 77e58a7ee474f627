"""The subcommands of ``relax-agent`` (:mod:`relax_agent.cli` holds the root command): one module per
command group, :func:`register` adds them all to the root app.

- :mod:`.training`: ``train``, ``scale``;
- :mod:`.evaluate`: ``eval``, ``replay``;
- :mod:`.view`: ``view``;
- :mod:`.envs`: ``envs list``, ``envs show``, ``envs audit``;
- :mod:`.agent`: ``agent check``;
- :mod:`.common`: the console, error reporting and config loading they share.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the command groups (``envs``, ``agent``) and the commands to ``app``, in the order ``--help`` lists them."""
    from relax_agent.commands.agent import agent_app
    from relax_agent.commands.envs import envs_app
    from relax_agent.commands.evaluate import eval_cmd, replay
    from relax_agent.commands.training import scale, train
    from relax_agent.commands.view import view

    app.add_typer(envs_app, name="envs")
    app.add_typer(agent_app, name="agent")
    app.command()(train)
    app.command("eval")(eval_cmd)
    app.command()(replay)
    app.command()(scale)
    app.command()(view)


__all__ = ["register"]
