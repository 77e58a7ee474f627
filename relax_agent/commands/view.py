"""``relax-agent view``: a run browsed in a local web page."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_agent.commands.common import console, fail
from relax_agent.errors import ConfigError, RelaxError


def view(
    run_dir: Path = typer.Argument(..., help="A run's run.output_dir (finished or still training)."),
    port: int = typer.Option(0, "--port", help="TCP port; 0 picks a free one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (keep it loopback unless you mean to share)."),
    token: str | None = typer.Option(None, "--token", help="A secret (16+ characters) every request must carry; "
                                     "default: none on a loopback --host, a fresh random one on any other."),
    tokenizer: str = typer.Option("auto", "--tokenizer",
                                  help="Tokenizer folder or hub id to show token ids as text; auto: the run's latest "
                                       "checkpoint's; none: ids only."),
) -> None:
    """Browse a run in a local web page: steps, groups, episodes, evaluation samples, curves."""
    from pydantic import ValidationError

    from relax_agent.netaddr import is_loopback
    from relax_agent.viewer import ViewerConfig, build

    if token is None and not is_loopback(host):
        import secrets

        token = secrets.token_urlsafe(24)
    try:
        try:
            server = build(ViewerConfig(run_dir=run_dir, host=host, port=port, token=token,
                                        tokenizer=None if tokenizer == "none" else tokenizer))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ConfigError(f"view: --{err['loc'][0]}={err.get('input')}: {err['msg']}") from None
    except RelaxError as exc:
        fail(exc)
        return
    if not is_loopback(host):
        console.print(f"[yellow]--host {host} is not a loopback address: anyone who reaches it and has the URL's "
                      "token can read the run[/]")
    console.print(f"viewing {server.reader.dir}; Ctrl-C stops")
    typer.echo(server.url)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C before uvicorn installed its handler
        pass
