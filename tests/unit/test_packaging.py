"""The wheel's package list, the public API and the error hierarchy stay as documented."""

import pickle
from pathlib import Path

import tomllib

import relax_agent
from relax_agent import errors

REPO = Path(__file__).resolve().parents[2]


def test_every_python_folder_is_packaged():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for pkg, folder in cfg["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            found.add(".".join((pkg, *init.parent.relative_to(REPO / folder).parts)))
    assert found == set(cfg["packages"]), f"[tool.setuptools] packages differs from the folders: {sorted(found ^ set(cfg['packages']))}"


def test_public_api_is_pinned():
    assert sorted(relax_agent.__all__) == [
        "CheckpointError", "ConfigError", "DataError", "EngineError", "EnvError", "Generation",
        "InferenceEngine", "ModelLoadError", "ParsedAction", "RelaxConfig", "RelaxError",
        "RewardServiceError", "RewardStatus", "SamplingParams", "SandboxError", "StopReason", "ToolCallParser",
        "Trajectory", "Turn",
        "__version__", "build_parser", "load_config", "register_parser",
    ]
    for name in relax_agent.__all__:
        assert hasattr(relax_agent, name)


def test_errors_subclass_their_builtin_and_pickle():
    pairs = {errors.ConfigError: ValueError, errors.EnvError: RuntimeError, errors.DataError: ValueError,
             errors.SandboxError: RuntimeError, errors.SandboxTimeoutError: TimeoutError,
             errors.AuthError: PermissionError, errors.ModelLoadError: OSError, errors.CheckpointError: OSError,
             errors.RuntimeServiceError: RuntimeError}
    for cls, builtin in pairs.items():
        assert issubclass(cls, errors.RelaxError) and issubclass(cls, builtin)
        err = pickle.loads(pickle.dumps(cls("trainer.lr: bad")))
        assert type(err) is cls and str(err) == "trainer.lr: bad"


def test_importing_the_package_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, relax_agent; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
