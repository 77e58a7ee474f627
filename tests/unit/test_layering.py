"""Dependencies run one way: a walk over every import (lazy ones inside functions included); and a
module's private (``_name``) names stay its own: no other module of the package imports them or reads
them off the module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"relax_agent": "relax_agent", "envs": "relax_agent.envs", "sandboxes": "relax_agent.sandboxes",
         "reward_services": "relax_agent.reward_services"}

WIRING = ("relax_agent.cli", "relax_agent.commands", "relax_agent.config", "relax_agent.control",
          "relax_agent.runtime", "relax_agent.roles", "relax_agent.preflight")
RULES = [
    # (importer prefix, forbidden prefixes, why)
    *[(p, ("relax_agent.train", "relax_agent.rollout", "relax_agent.control", "relax_agent.runtime",
           "relax_agent.weights", "relax_agent.data", *WIRING), "plugins know nothing of training")
      for p in ("relax_agent.envs", "relax_agent.sandboxes", "relax_agent.reward_services")],
    ("relax_agent.rollout", ("relax_agent.train", *WIRING), "rollout meets the trainer only through records"),
    ("relax_agent.train", ("relax_agent.rollout", *WIRING), "the trainer meets rollout only through records"),
    ("relax_agent.data", ("relax_agent.train", "relax_agent.rollout", "relax_agent.moe", "relax_agent.records",
                          "relax_agent.control", "relax_agent.runtime", *WIRING), "the bus knows fields, no algorithm"),
    ("relax_agent.weights", ("relax_agent.train", "relax_agent.control", "relax_agent.runtime", *WIRING),
     "weight sync knows tensors, not trainers"),
    ("relax_agent.records", ("relax_agent.rollout", "relax_agent.train", *WIRING), "records are neutral"),
    ("relax_agent.runtime", ("relax_agent.cli", "relax_agent.commands", "relax_agent.control"),
     "services do not drive the loop"),
    ("relax_agent.multimodal", WIRING, "media codecs and placeholder arithmetic know no wiring"),
    ("relax_agent.control", ("relax_agent.models", "relax_agent.roles", "relax_agent.train.backends",
                             "relax_agent.rollout.engines.hf", "relax_agent.rollout.engines.vllm_engine",
                             "relax_agent.rollout.engines.vllm_server"),
     "the loop drives services; it loads no model (the caller hands it the roles)"),
    ("relax_agent.viewer", ("relax_agent.train", "relax_agent.rollout", "relax_agent.control", "relax_agent.runtime",
                            "relax_agent.weights", "relax_agent.data", *WIRING), "the viewer reads a run's files, nothing else"),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    root = ROOTS[parts[0]].split(".")
    parts = root + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in out if m.startswith("relax_agent")}


def edges() -> list[tuple[str, str, str]]:
    found = []
    for top in ROOTS:
        for path in sorted((REPO / top).rglob("*.py")):
            found += [(module_name(path), imported, str(path.relative_to(REPO))) for imported in imports(path)]
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_forbidden_import_edge():
    bad = []
    for importer, imported, where in edges():
        for prefix, forbidden, why in RULES:
            if not _under(importer, prefix):
                continue
            for f in forbidden:
                if _under(imported, f) and not _under(imported, prefix):
                    bad.append(f"{where}: {importer} imports {imported} ({why})")
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("importer, imported", [("relax_agent.rollout.chat", "relax_agent.train.batch"),
                                                ("relax_agent.data.store", "relax_agent.train.algorithms"),
                                                ("relax_agent.envs.calculator", "relax_agent.rollout.runner")])
def test_the_rules_catch_a_forbidden_edge(importer, imported):
    hits = [why for prefix, forbidden, why in RULES if _under(importer, prefix)
            and any(_under(imported, f) for f in forbidden)]
    assert hits


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def package_modules() -> set[str]:
    return {module_name(path) for top in ROOTS for path in (REPO / top).rglob("*.py")}


def private_uses(source: str, importer: str, is_package: bool, modules: set[str]) -> list[str]:
    """Private names of other modules that ``importer``'s source uses: ``from m import _name`` (lazy
    imports inside functions included; a package's ``__init__`` is another module to its submodules)
    and ``m._name`` on a package module bound by an import."""
    tree = ast.parse(source)
    package = importer if is_package else importer.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> the package module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("relax_agent"):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("relax_agent"):
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in modules:  # `from pkg import submodule`
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
                elif _private(a.name) and mod != importer:
                    found.append(f"line {node.lineno}: from {mod} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *reversed(chain)])
                if owner in modules and owner != importer:
                    found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name used by another module is the package's internal API: it has no leading underscore."""
    modules = package_modules()
    bad = []
    for top in ROOTS:
        for path in sorted((REPO / top).rglob("*.py")):
            uses = private_uses(path.read_text(), module_name(path), path.name == "__init__.py", modules)
            bad += [f"{path.relative_to(REPO)}, {use}" for use in uses]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("importer, is_package, source", [
    ("relax_agent.control.loop", False, "from relax_agent.control.pipeline import KEEPER, _Run\n"),
    ("relax_agent.runtime.ray_trainer.service", False,
     "def kill(pid):\n    from relax_agent.runtime.ray_supervisor import _kill_ray_worker\n"),
    ("relax_agent.data.store.puts", False, "from .state import (\n    Lease,\n    _Partition,\n)\n"),
    ("relax_agent.data.store.store", False, "from relax_agent.data.store import _private_helper\n"),
    ("relax_agent.data.store", True, "from .state import _Partition\n"),
    ("relax_agent.sandboxes.bubblewrap", False, "from relax_agent.sandboxes import reaper\nreaper._start_ticks(1)\n"),
    ("relax_agent.sandboxes.bubblewrap", False,
     "import relax_agent.sandboxes.reaper\nrelax_agent.sandboxes.reaper._start_ticks(1)\n"),
])
def test_the_private_name_rule_catches_a_use(importer, is_package, source):
    assert private_uses(source, importer, is_package, package_modules())


@pytest.mark.parametrize("importer, source", [
    ("relax_agent.cli", "from relax_agent import __version__\n"),  # dunders are public
    ("relax_agent.sandboxes.bubblewrap", "from relax_agent.sandboxes._process import run_process\n"),
    ("relax_agent.sandboxes.bubblewrap", "from relax_agent.sandboxes import reaper\nreaper.start_ticks(1)\n"),
])
def test_the_private_name_rule_lets_public_names_through(importer, source):
    assert private_uses(source, importer, False, package_modules()) == []


def test_module_names_follow_the_package_dir_mapping():
    assert module_name(REPO / "envs" / "bfcl" / "env.py") == "relax_agent.envs.bfcl.env"
    assert module_name(REPO / "relax_agent" / "data" / "__init__.py") == "relax_agent.data"
