"""Image builder: apt mirror discovery and the build paths, with a fake Docker client."""

from __future__ import annotations

from pathlib import Path

import docker.errors
import pytest

from relax_agent.errors import SandboxError
from relax_agent.sandboxes import image


def _apt(tmp_path: Path, sources_list: str = "", extra: dict[str, str] | None = None) -> Path:
    (tmp_path / "sources.list.d").mkdir(parents=True)
    (tmp_path / "sources.list").write_text(sources_list)
    for name, text in (extra or {}).items():
        (tmp_path / "sources.list.d" / name).write_text(text)
    return tmp_path


def test_mirror_from_deb822_skips_security_and_third_party(tmp_path):
    apt = _apt(tmp_path, extra={
        "debian.sources": (
            "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
            "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
            "Components: main\n"
        ),
        "node.list": "deb [signed-by=/k.gpg] https://deb.nodesource.com/node_20.x nodistro main\n",
    })
    assert image.debian_mirror("bookworm", apt) == "http://mirror.example/debian"


def test_mirror_from_one_line_format_with_options(tmp_path):
    apt = _apt(tmp_path, "# comment\ndeb-src http://src.example/debian bookworm main\n"
                         "deb [arch=amd64 signed-by=/x.gpg] http://one.example/debian bookworm main contrib\n")
    assert image.debian_mirror("bookworm", apt) == "http://one.example/debian"


def test_mirror_missing_suite_raises(tmp_path):
    apt = _apt(tmp_path, "deb http://one.example/debian bullseye main\n")
    with pytest.raises(SandboxError, match="serves suite 'bookworm'.*--mirror"):
        image.debian_mirror("bookworm", apt)


class FakeImages:
    def __init__(self, present=()):
        self.present = set(present)
        self.built = []

    def get(self, name):
        if name not in self.present:
            raise docker.errors.ImageNotFound(name)
        return type("Img", (), {"id": f"sha256:{name}"})()

    def build(self, path, dockerfile, tag, rm):
        self.built.append((Path(path, dockerfile).read_text(), tag))
        self.present.add(tag)
        return self.get(tag), []


class FakeAPI:
    def __init__(self, images):
        self.images = images
        self.imports = []

    def import_image_from_file(self, filename, repository, tag, changes):
        assert Path(filename).stat().st_size > 0
        self.imports.append((repository, tag, changes))
        self.images.present.add(f"{repository}:{tag}")


class FakeClient:
    def __init__(self, present=()):
        self.images = FakeImages(present)
        self.api = FakeAPI(self.images)


def test_existing_image_is_not_rebuilt():
    client = FakeClient(present=["relax-agent/python:bookworm"])
    assert image.build_image(client) == ("relax-agent/python:bookworm", False)
    assert client.images.built == [] and client.api.imports == []


def test_dockerfile_build_uses_suite_and_tag():
    client = FakeClient()
    assert image.build_image(client, "me/py:1", method="dockerfile", suite="trixie") == ("me/py:1", True)
    text, tag = client.images.built[0]
    assert tag == "me/py:1" and "FROM debian:trixie-slim" in text and "python3-minimal" in text


def test_debootstrap_build_imports_the_rootfs(monkeypatch):
    calls = []

    def fake_run(argv, what):
        calls.append(argv)
        if argv[0] == "debootstrap":
            rootfs = Path(argv[-2])
            (rootfs / "usr/bin").mkdir(parents=True)
            (rootfs / "usr/bin/python3").write_text("#!")
            (rootfs / "usr/share/doc/x").mkdir(parents=True)
        else:
            Path(argv[argv.index("-cf") + 1]).write_bytes(b"tar")

    monkeypatch.setattr(image, "_run", fake_run)
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image.shutil, "which", lambda name: f"/usr/sbin/{name}")
    client = FakeClient()
    image.build_with_debootstrap(client, "relax-agent/python:bookworm", mirror="http://m.example/debian")
    assert calls[0][:4] == ["debootstrap", "--variant=minbase", "--include=python3-minimal", "bookworm"]
    assert calls[0][-1] == "http://m.example/debian"
    repo, tag, changes = client.api.imports[0]
    assert (repo, tag) == ("relax-agent/python", "bookworm")
    assert any(c.startswith("ENV PATH=") for c in changes)


def test_debootstrap_needs_root(monkeypatch):
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="needs root"):
        image.build_with_debootstrap(FakeClient())
    with pytest.raises(SandboxError, match="unknown build method 'nope'"):
        image.build_image(FakeClient(), method="nope")  # type: ignore[arg-type]
