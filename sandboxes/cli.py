"""``relax-agent sandbox``: build the base image, remove leaked sandbox containers."""

from __future__ import annotations

import typer

from relax_agent.errors import SandboxError
from relax_agent.sandboxes.image import DEFAULT_IMAGE, DEFAULT_SUITE

app = typer.Typer(no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Build sandbox images and reap leaked sandboxes.")


def _client(docker_host: str | None):
    from relax_agent.sandboxes.config import SandboxConfig
    from relax_agent.sandboxes.docker import docker_client

    client, _ = docker_client(SandboxConfig(docker_host=docker_host, reap_on_start=False))
    return client


@app.command("build-image")
def build_image_cmd(
    image: str = typer.Option(DEFAULT_IMAGE, help="Image name:tag to build (sandbox.image)."),
    method: str = typer.Option("auto", help="debootstrap (offline, needs root), dockerfile (needs a registry), or auto."),
    suite: str = typer.Option(DEFAULT_SUITE, help="Debian suite of the base system."),
    mirror: str | None = typer.Option(None, help="Debian mirror URL (default: the one apt uses here)."),
    dockerfile: str | None = typer.Option(None, help="Your own Dockerfile (method dockerfile)."),
    force: bool = typer.Option(False, help="Rebuild even if the image exists."),
    docker_host: str | None = typer.Option(None, help="Docker daemon URL (default: DOCKER_HOST or the local socket)."),
) -> None:
    """Build the base Python sandbox image (skipped when it already exists)."""
    from relax_agent.sandboxes.image import build_image

    if method not in ("auto", "debootstrap", "dockerfile"):
        raise typer.BadParameter(f"--method {method!r}: expected auto, debootstrap or dockerfile")
    try:
        name, built = build_image(_client(docker_host), image, method=method, suite=suite, mirror=mirror,  # type: ignore[arg-type]
                                  dockerfile=dockerfile, force=force)
    except SandboxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"built {name}" if built else f"{name} already exists (use --force to rebuild)")


@app.command("reap")
def reap_cmd(
    run_id: str | None = typer.Option(None, help="Remove exactly this run's containers."),
    all_: bool = typer.Option(False, "--all", help="Remove every sandbox container, also of live runs."),
    dry_run: bool = typer.Option(False, help="List what would be removed."),
    docker_host: str | None = typer.Option(None, help="Docker daemon URL."),
    backend: str = typer.Option("all", help="all, docker (containers only) or bubblewrap (work dirs only)."),
) -> None:
    """Remove sandbox containers of dead or expired runs (label relax-agent.sandbox) and the
    bubblewrap work dirs (<tmp>/relax-bwrap-*) of processes that died without removing them.
    Work dirs of live processes are kept, also with --all; --run-id reaps containers only."""
    from relax_agent.sandboxes.bubblewrap import reap_work_dirs
    from relax_agent.sandboxes.reaper import reap

    if backend not in ("all", "docker", "bubblewrap"):
        raise typer.BadParameter(f"--backend {backend!r}: expected all, docker or bubblewrap")
    verb = "would remove" if dry_run else "removed"
    if backend != "docker" and run_id is None:
        dirs = reap_work_dirs(dry_run=dry_run)
        for d in dirs:
            typer.echo(f"{verb} {d} (bubblewrap work dir of a dead process)")
        typer.echo(f"{verb} {len(dirs)} bubblewrap work dir(s)")
    if backend == "bubblewrap":
        return
    try:
        reaped = reap(_client(docker_host), run_id=run_id, everything=all_, dry_run=dry_run)
    except SandboxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for r in reaped:
        typer.echo(f"{verb} {r.name} (run {r.run_id}: {r.reason})")
    typer.echo(f"{verb} {len(reaped)} sandbox container(s)")
