"""Fixtures and helpers shared by the test files.

The fixtures are registered for every test by ``tests/conftest.py`` (``pytest_plugins``); import the
helpers by name, e.g. ``from tests.fixtures import chat_prompt``. Heavy libraries (torch, transformers)
are imported inside the functions, so collecting a test that needs none of them stays cheap.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def open_dir() -> Any:
    """A 0777 directory outside /tmp's jail view and pytest's root-only tmp_path: a jailed agent (an
    unprivileged uid) can read its script from it and write reports into it; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="relax-agent-test-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hf_policy(tiny_model_dir: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the tiny random llama (fp32, CPU), loaded again for each test."""
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_policy

    return load_policy(ModelConfig(path=str(tiny_model_dir)))


def load_media_policy(folder: Path) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, renderer)`` of the media policy in ``folder`` (a ``make_tiny_media_model`` output)."""
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_media_processor, load_policy
    from relax_agent.multimodal.render import MediaRenderer
    from relax_agent.rollout.chat import ChatRenderer

    cfg = ModelConfig(path=str(folder))
    model, tok = load_policy(cfg)
    return model, tok, MediaRenderer(ChatRenderer(tok, accepts_media=True), load_media_processor(cfg, model.config))


def chat_prompt(tokenizer: Any, words: int, offset: int = 0) -> list[int]:
    """Token ids of a one-message chat prompt of ``words`` distinct words (``word{offset}`` onwards)."""
    msgs = [{"role": "user", "content": " ".join(f"word{offset + i}" for i in range(words))}]
    ids: list[int] = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    return ids


def reference_logprobs(model: Any, prompt: list[int], completion: tuple[int, ...], temperature: float = 1.0,
                       top_p: float = 1.0) -> Any:
    """[n] log_softmax(logits / T) at each completion token, from one unpadded forward pass (the trainer's
    view); with ``top_p < 1``, of the nucleus renormalised (what vLLM samples from and reports)."""
    import torch

    from relax_agent.rollout.engines.hf import top_p_filter

    ids = torch.tensor([prompt + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)[len(prompt) - 1:-1]
    picked = logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    if top_p < 1:
        nucleus = top_p_filter(logp.exp(), torch.full((len(completion),), top_p))
        picked = picked - nucleus.sum(-1).log()
    return picked


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``fn()`` in a daemon thread; the box gets ``"result"``, or ``"error"`` with what it raised."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # reported by the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, proc: Any = None, poll_s: float = 0.05) -> Any:
    """Poll ``cond()`` until it is truthy and return its value; fail after ``timeout_s`` naming ``what``,
    or at once when the ``subprocess.Popen`` ``proc`` (if given) has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert proc is None or proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def require_dev_tools(*modules: str, what: str, extra: str = "dev") -> pytest.MarkDecorator:
    """A skip mark for tests that need the dev tools ``modules`` (``"ruff"``, ``"mypy"``): a no-op mark
    when all are installed; skipped without them, except under ``CI=true``, where a missing tool is a
    broken set-up and fails at once (``scripts/setup.sh`` installs them with the dev extra)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {what} is not installed ({', '.join(missing)}): scripts/setup.sh installs it "
                    "with the dev extra", pytrace=False)
    return pytest.mark.skipif(bool(missing), reason=f"{what} is not installed (pip install -e '.[{extra}]' installs it)")
