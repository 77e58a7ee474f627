"""The ``relax-agent`` command: wires config to the controller, nothing more."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="relax-agent",
    help="Asynchronous RL post-training for agentic, tool-using language models.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _add_subcommands() -> None:
    from relax_agent.sandboxes.cli import app as sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="Build sandbox images and reap leaked sandboxes.")
    from relax_agent.reward_services.cli import serve_reward

    app.command("serve-reward")(serve_reward)


def main() -> None:
    """Entry point of the ``relax-agent`` console script."""
    _add_subcommands()
    app()


if __name__ == "__main__":
    main()
