"""The docs page "How a step works" (``docs/concepts/step.md``) names the function behind each
step: every dotted name it cites (``Class.method``, ``module.function``) is defined in the package,
so a rename that leaves the page behind fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


PAGE = REPO / "docs" / "concepts" / "step.md"


def definitions() -> tuple[dict[str, set[str]], set[str]]:
    """Class name -> its method names, and every module-level ``module.function`` of the package."""
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for path in (REPO / "relax_agent").rglob("*.py"):
        module = ".".join(path.relative_to(REPO / "relax_agent").with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(f"{module}.{node.name}")
    return classes, functions


def test_every_function_the_step_walkthrough_names_exists():
    from relax_agent.config import RelaxConfig

    classes, functions = definitions()
    cited = set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", PAGE.read_text()))
    sections = set(RelaxConfig.model_fields)
    cited = {c for c in cited if c.split(".")[0] not in sections}  # config keys (trainer.loss, ...)
    assert len(cited) >= 15, cited  # the walkthrough names its functions
    missing = []
    for name in sorted(cited):
        owner, _, attr = name.rpartition(".")
        if owner.startswith("relax_agent."):  # a full path: the module's file defines it
            path = REPO / Path(*owner.split(".")).with_suffix(".py")
            ok = path.exists() and re.search(rf"^(class|def) {attr}\b", path.read_text(), re.M) is not None
        elif owner in classes:
            ok = attr in classes[owner]
        else:
            ok = name in functions or any(f.endswith("." + name) for f in functions)
        if not ok:
            missing.append(name)
    assert missing == [], f"{PAGE.relative_to(REPO)} cites names the code does not define: {missing}"
