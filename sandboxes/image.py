"""Build the base sandbox image without a registry (debootstrap) or from a Dockerfile.

The offline path (measured ~30 s on a 2-core machine) is::

    debootstrap --variant=minbase --include=python3-minimal bookworm ROOTFS MIRROR
    tar -C ROOTFS -c . | docker import - relax-agent/python:bookworm

``MIRROR`` is the Debian mirror apt already uses on this machine (read from
``/etc/apt/sources.list*``), so nothing but Debian's package mirror has to be reachable.
The image has coreutils ``timeout`` (used to enforce exec timeouts inside the container),
``python3`` and the ``nobody`` user (uid 65534) that sandboxed commands run as.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Literal

from relax_agent.errors import SandboxError

DEFAULT_IMAGE = "relax-agent/python:bookworm"
DEFAULT_SUITE = "bookworm"
IMAGE_LABEL = "relax-agent.image"
_IMAGE_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    f"LABEL {IMAGE_LABEL}=base",
]
DOCKERFILE = """\
FROM debian:{suite}-slim
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3-minimal \\
 && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8
LABEL {label}=base
"""
_TRIM = ["var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"]

BuildMethod = Literal["auto", "debootstrap", "dockerfile"]


def _deb822_uris(text: str) -> list[tuple[str, list[str]]]:
    entries = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith(("#", " ")):
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and "uris" in fields:
            suites = fields.get("suites", "").split()
            entries += [(uri, suites) for uri in fields["uris"].split()]
    return entries


def _one_line_uris(text: str) -> list[tuple[str, list[str]]]:
    entries = []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 3 and parts[0] == "deb":
            rest = parts[1:]
            if rest[0].startswith("["):  # options such as [signed-by=...]
                while rest and not rest[0].endswith("]"):
                    rest = rest[1:]
                rest = rest[1:]
            if len(rest) >= 2:
                entries.append((rest[0], [rest[1]]))
    return entries


def debian_mirror(suite: str = DEFAULT_SUITE, apt_dir: str | Path = "/etc/apt") -> str:
    """The Debian archive URI apt uses on this machine for ``suite``.

    Reads ``sources.list`` and ``sources.list.d/*.list`` (one-line format) and
    ``sources.list.d/*.sources`` (deb822). Security and third-party repositories are skipped:
    the URI must serve ``suite`` itself.

    Raises:
        SandboxError: no apt source serves ``suite``; pass ``--mirror`` instead.
    """
    apt = Path(apt_dir)
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
    entries: list[tuple[str, list[str]]] = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        entries += _deb822_uris(text) if path.suffix == ".sources" else _one_line_uris(text)
    for uri, suites in entries:
        if suite in suites:
            return uri.rstrip("/")
    raise SandboxError(f"no apt source in {apt}/sources.list* serves suite {suite!r}; pass --mirror URL")


def image_exists(client: Any, image: str) -> bool:
    """True when the Docker daemon behind ``client`` has ``image``."""
    import docker.errors

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise SandboxError(f"{what} failed (exit {proc.returncode}): {' '.join(argv[:4])} ...\n{tail}")


def build_with_debootstrap(client: Any, image: str = DEFAULT_IMAGE, *, suite: str = DEFAULT_SUITE,
                           mirror: str | None = None, work_dir: str | None = None) -> str:
    """Build ``image`` offline: debootstrap a minimal ``suite`` root file system and import it.

    Needs root and the ``debootstrap`` and ``tar`` commands on the host (``scripts/setup_docker.sh``
    installs them). Returns the image id.

    Raises:
        SandboxError: not root, debootstrap missing or failing, or the import failing.
    """
    if os.geteuid() != 0:
        raise SandboxError("build-image --method debootstrap needs root (debootstrap creates device nodes)")
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed; run scripts/setup_docker.sh or apt-get install debootstrap")
    mirror = mirror or debian_mirror(suite)
    with tempfile.TemporaryDirectory(prefix="relax-image-", dir=work_dir) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", "--include=python3-minimal", suite, str(rootfs), mirror],
             "debootstrap")
        for rel in _TRIM:
            target = rootfs / rel
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir(parents=True)
        tarball = Path(tmp) / "rootfs.tar"
        _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], "tar")
        repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
        client.api.import_image_from_file(str(tarball), repository=repo, tag=tag, changes=_IMAGE_CHANGES)
    return client.images.get(image).id


def build_with_dockerfile(client: Any, image: str = DEFAULT_IMAGE, *, suite: str = DEFAULT_SUITE,
                          dockerfile: str | Path | None = None) -> str:
    """Build ``image`` with ``docker build`` (needs a reachable registry for the ``FROM`` image).

    ``dockerfile`` is a path to a Dockerfile (its folder is the build context); by default
    :data:`DOCKERFILE` for ``suite`` is used. Returns the image id.

    Raises:
        SandboxError: the build failed (often: no registry reachable; use ``--method debootstrap``).
    """
    import docker.errors

    with tempfile.TemporaryDirectory(prefix="relax-image-") as tmp:
        if dockerfile is None:
            path = Path(tmp) / "Dockerfile"
            path.write_text(DOCKERFILE.format(suite=suite, label=IMAGE_LABEL))
        else:
            path = Path(dockerfile)
            if not path.is_file():
                raise SandboxError(f"--dockerfile {str(path)!r} does not exist")
        try:
            built, _logs = client.images.build(path=str(path.parent), dockerfile=path.name, tag=image, rm=True)
        except (docker.errors.BuildError, docker.errors.APIError) as exc:
            raise SandboxError(
                f"docker build of {image!r} failed ({exc}); without a registry use --method debootstrap"
            ) from exc
    return built.id


def build_image(client: Any, image: str = DEFAULT_IMAGE, *, method: BuildMethod = "auto",
                suite: str = DEFAULT_SUITE, mirror: str | None = None, dockerfile: str | Path | None = None,
                force: bool = False) -> tuple[str, bool]:
    """Build the sandbox image unless it already exists; returns ``(image, built)``.

    ``method="auto"`` uses debootstrap when running as root with debootstrap installed (works
    without a registry), else a Dockerfile build.

    Raises:
        SandboxError: the chosen method failed, or ``method`` is unknown.
    """
    if not force and image_exists(client, image):
        return image, False
    if method == "auto":
        method = "debootstrap" if os.geteuid() == 0 and shutil.which("debootstrap") else "dockerfile"
    if method == "debootstrap":
        build_with_debootstrap(client, image, suite=suite, mirror=mirror)
    elif method == "dockerfile":
        build_with_dockerfile(client, image, suite=suite, dockerfile=dockerfile)
    else:
        raise SandboxError(f"unknown build method {method!r}; expected auto, debootstrap or dockerfile")
    return image, True
