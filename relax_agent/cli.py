"""The ``relax-agent`` command: wires config to the controller, nothing more. The subcommands live in
:mod:`relax_agent.commands`."""

from __future__ import annotations

import sys

import typer

from relax_agent.commands import register

app = typer.Typer(
    name="relax-agent",
    help="Asynchronous RL post-training for agentic, tool-using language models.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
register(app)


def _version(value: bool) -> None:
    if value:
        from relax_agent import __version__

        typer.echo(f"relax-agent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Asynchronous RL post-training for agentic, tool-using language models."""


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
