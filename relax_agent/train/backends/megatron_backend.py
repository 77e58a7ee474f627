"""The megatron trainer backend: a Megatron-core ``GPTModel`` trained by rank processes.

``trainer.backend: megatron`` converts the Hugging Face policy into a Megatron ``GPTModel``
(:mod:`relax_agent.train.megatron.convert`), split over ``trainer.megatron.tensor_parallel``
ranks (experts over ``expert_parallel`` of them), and trains it with the torch backend's loss
path (GRPO / PPO-clip, KL, TIS, mismatch metrics, precision options; see
:class:`~relax_agent.train.megatron.rank.RankTrainer`).

Where the ranks run: every rank, rank 0 included, is a subprocess
(``python -m relax_agent.train.megatron.rank``, connected back over an authenticated local
socket; not ``multiprocessing`` spawn, which re-runs the caller's main script), and
:class:`MegatronTrainer`, the object the control loop holds, is a thin proxy that sends each
command to every rank and returns rank 0's answer. Why not rank 0 in-process: Megatron keeps
its process groups and RNG trackers in module globals, and on CPU the backend patches
``torch.cuda.current_device``; in subprocesses none of that touches the control loop's
process (which may also host the rollout engine, other trainers, or a test session), a
rank that crashes is reported as an error instead of taking the loop down, and TP=1 and
TP=2 run the same code.

Weight sync: rank 0 gathers every rank's shards (``gather_object``) and joins them into
Hugging Face names (:func:`~relax_agent.train.megatron.convert.ranks_to_hf`); the proxy hands
that full state dict to the weight sync. Gathering on the trainer side keeps the DCS and the
engines unaware of the trainer's layout (the engine's TP need not match the trainer's), at
the cost of one full copy per publish on rank 0 and one pipe transfer (shared memory) to the
proxy; streaming shards to the engines is the change to make when that copy dominates.

Checkpoints: :meth:`MegatronTrainer.save_model` writes Hugging Face safetensors (loadable by
the policy loader, so a resume rebuilds the ranks from them) and :meth:`MegatronTrainer.state_dict`
holds each rank's optimizer shard, scheduler and step, keyed by the parallel layout.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch

from relax_agent.errors import CheckpointError, ConfigError, RelaxError
from relax_agent.train.batch import TrainBatch
from relax_agent.train.config import TrainerConfig

INSTALL_HINT = "pip install 'relax-agent[megatron]' (megatron-core)"
AUTHKEY_ENV = "RELAX_MEGATRON_AUTHKEY"
"""Environment variable carrying the rank connection's authentication key (hex) to the ranks."""
READY_TIMEOUT_S = 600.0
"""Seconds a rank may take to import megatron, convert and load its shard."""


class MegatronTrainerError(RelaxError, RuntimeError):
    """A rank process failed; the message holds the rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_megatron_installed() -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # a module named megatron that is not the package
        found = False
    if not found:
        raise ConfigError(f"trainer.backend=megatron needs megatron-core: {INSTALL_HINT}")


class MegatronTrainer:
    """Implements :class:`~relax_agent.train.backends.base.Trainer` by driving Megatron rank processes.

    Each rank runs the torch backend's loss path, so ``trainer.loss`` (PPO-clip, GSPO, CISPO) and
    ``trainer.mismatch`` behave exactly as there; ``trainer.advantage`` and ``rollout.overlong`` act
    before the trainer (the control loop), whatever the backend.

    Args:
        model: the Hugging Face policy (its config and current weights, under their in-memory
            names, are written to a temporary folder that each rank loads its shard from).
        cfg: the trainer section; ``cfg.megatron`` gives the layout.
        device: "cpu" (gloo, CPU patches) or "cuda" (NCCL; rank i on GPU i).
        temperature: the rollout's sampling temperature.
        routing_replay: R3 for MoE policies (ignored, with the torch backend's warning, for dense ones).

    Raises:
        ConfigError: megatron-core missing, a family or size the conversion does not map, or a
            layout that does not divide the model (the message names the key).
        MegatronTrainerError: a rank failed to start.
    """

    def __init__(self, model: Any, cfg: TrainerConfig, device: str = "cpu", temperature: float = 1.0,
                 routing_replay: bool = False) -> None:
        from relax_agent.train.megatron.convert import check_parallel, model_spec

        _check_megatron_installed()
        if model is None:
            raise ConfigError("trainer.backend=megatron needs the policy model (build(model=...))")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0; got {temperature}")
        mcfg = cfg.megatron
        self.spec = model_spec(model.config)
        check_parallel(self.spec, mcfg.tensor_parallel, mcfg.expert_parallel)
        if self.spec.is_moe and mcfg.tensor_parallel > 1 and not mcfg.sequence_parallel:
            raise ConfigError(f"an MoE policy with trainer.megatron.tensor_parallel={mcfg.tensor_parallel} needs "
                              "trainer.megatron.sequence_parallel=true (Megatron refuses MoE training under TP "
                              "without it)")
        if routing_replay and not self.spec.is_moe:
            import warnings

            warnings.warn(f"moe.routing_replay=rollout is ignored: the {self.spec.family} policy is dense "
                          "(no experts to replay)", stacklevel=3)
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"trainer.backend=megatron runs on cpu or cuda; got device {device!r}")
        self.cfg = cfg
        self.world_size = mcfg.world_size
        self.step = 0
        self._dir = tempfile.mkdtemp(prefix="relax-megatron-")
        from relax_agent.train.megatron.rank import write_hf_folder

        write_hf_folder(Path(self._dir), model.config.to_dict(), model.state_dict(), self.spec.tied)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(self._dir)
        self._start(mcfg, kind, temperature, routing_replay and self.spec.is_moe)

    def _start(self, mcfg: Any, kind: str, temperature: float, routing_replay: bool) -> None:
        from relax_agent.train.megatron.rank import RankSetup

        threads = max(1, torch.get_num_threads() // self.world_size)
        setup = RankSetup(hf_dir=self._dir, cfg=self.cfg, world_size=self.world_size,
                          tensor_parallel=mcfg.tensor_parallel, expert_parallel=mcfg.expert_parallel,
                          sequence_parallel=mcfg.sequence_parallel, init_method=f"tcp://127.0.0.1:{_free_port()}",
                          device=kind, temperature=temperature, routing_replay=routing_replay, num_threads=threads)
        setup_path = Path(self._dir) / "rank_setup.pkl"
        setup_path.write_bytes(pickle.dumps(setup))
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        host, port = listener.address
        self._procs = [subprocess.Popen([sys.executable, "-m", "relax_agent.train.megatron.rank", str(rank),
                                         f"{host}:{port}", str(setup_path)], env=env)
                       for rank in range(self.world_size)]
        self._conns: list[Any] = [None] * self.world_size
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs, self._dir)
        try:
            for conn in _accept(listener, self.world_size, self._procs, READY_TIMEOUT_S):
                self._conns[_recv(conn)] = conn
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for rank in range(self.world_size):
            self._receive(rank, timeout_s=READY_TIMEOUT_S, expect="ready")

    # ----------------------------------------------------------------- the rank protocol

    def _receive(self, rank: int, timeout_s: float | None = None, expect: str = "ok") -> Any:
        conn, proc = self._conns[rank], self._procs[rank]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if proc.poll() is not None:
                self.close()
                raise MegatronTrainerError(f"megatron rank {rank} exited with code {proc.returncode}")
            if timeout_s is not None and waited >= timeout_s:
                self.close()
                raise MegatronTrainerError(f"megatron rank {rank} did not answer within {timeout_s} s")
        try:
            status, payload = _recv(conn)
        except EOFError as exc:
            self.close()
            raise MegatronTrainerError(f"megatron rank {rank} closed its connection (exit code {proc.poll()})") from exc
        if status == "error":
            err, trace = payload
            if expect == "ready":
                self.close()
            if isinstance(err, RelaxError):
                raise err
            raise MegatronTrainerError(f"megatron rank {rank} failed:\n{trace}") from err
        return payload

    def _call(self, command: str, args: tuple = (), per_rank: list[tuple] | None = None) -> list[Any]:
        """Send ``command`` to every rank (``args``, or ``per_rank[i]`` to rank i) and collect the answers."""
        if not self._finalizer.alive:
            raise MegatronTrainerError("the megatron trainer is closed")
        sends = per_rank if per_rank is not None else [args] * self.world_size
        for conn, a in zip(self._conns, sends, strict=True):
            _send(conn, (command, a))
        results, error = [], None
        for rank in range(self.world_size):  # read every answer so the pipes stay in step
            try:
                results.append(self._receive(rank))
            except RelaxError as exc:
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results

    # ----------------------------------------------------------------- Trainer protocol

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on ``batch`` on every rank; rank 0's metrics (the torch backend's keys).

        Raises:
            DataError: the batch has no policy tokens or its routes do not fit the model.
        """
        metrics = self._call("train_step", (batch.to("cpu"),))[0]
        self.step = int(metrics["train/step"])
        return metrics

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised warm-up update on every rank (see ``TorchTrainer.sft_step``); rank 0's metrics.

        Raises:
            DataError: the batch has no loss tokens.
        """
        return self._call("sft_step", (batch.to("cpu"), lr))[0]

    def end_sft(self) -> None:
        """Drop the warm-up optimizer on every rank."""
        self._call("end_sft")

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy in Hugging Face names (gathered from every rank's shards; a copy)."""
        return self._call("policy_state_dict")[0]

    def state_dict(self) -> dict[str, Any]:
        """Every rank's optimizer, scheduler, loss scaler and step, with the layout they fit."""
        mcfg = self.cfg.megatron
        return {"backend": "megatron", "layout": {"tensor_parallel": mcfg.tensor_parallel,
                                                  "expert_parallel": mcfg.expert_parallel},
                "ranks": self._call("state_dict"), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the weights came with the model).

        Raises:
            CheckpointError: the state is not a megatron trainer's or was saved with another layout.
        """
        if state.get("backend") != "megatron" or "ranks" not in state:
            raise CheckpointError(f"trainer state is not a megatron trainer's (keys {sorted(state)}); "
                                  "resume with the trainer.backend it was saved with")
        mcfg = self.cfg.megatron
        layout = {"tensor_parallel": mcfg.tensor_parallel, "expert_parallel": mcfg.expert_parallel}
        if state.get("layout") != layout or len(state["ranks"]) != self.world_size:
            raise CheckpointError(f"the checkpoint's optimizer shards fit trainer.megatron {state.get('layout')}; "
                                  f"this run has {layout}")
        self._call("load_state_dict", per_rank=[(s,) for s in state["ranks"]])
        self.step = int(state["step"])

    def save_model(self, path: Path) -> None:
        """Rank 0 writes ``config.json`` and ``model.safetensors`` (Hugging Face names) into ``path``."""
        self._call("save_model", (Path(path),))

    # ----------------------------------------------------------------- checks

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, V] logits of the Megatron model (no gradient): conversion checks and benchmarks."""
        return self._call("logits", (input_ids, attention_mask))[0]

    def gradients(self, batch: TrainBatch) -> dict[str, Any]:
        """``{"grads": HF name -> full gradient, "metrics": ...}`` of ``batch`` without an update."""
        return self._call("gradients", (batch.to("cpu"),))[0]

    def close(self) -> None:
        """Stop the rank processes and remove the weights folder (idempotent)."""
        self._finalizer()

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _send(conn: Any, obj: Any) -> None:
    """Plain pickle (tensors by value): torch's shared-memory reductions need related processes."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _accept(listener: Any, n: int, procs: list[Any], timeout_s: float) -> list[Any]:
    """``n`` connections from the rank processes; fails when one exits or none comes within ``timeout_s``."""
    conns: list[Any] = []
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            for _ in range(n):
                conns.append(listener.accept())
        except BaseException as exc:  # the listener was closed, or a client failed authentication
            errors.append(exc)

    thread = threading.Thread(target=accept, daemon=True, name="relax-megatron-accept")
    thread.start()
    waited = 0.0
    while thread.is_alive():
        thread.join(0.5)
        waited += 0.5
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead or waited >= timeout_s:
            listener.close()
            what = f"exited with code {procs[dead[0]].returncode}" if dead else f"did not connect within {timeout_s} s"
            raise MegatronTrainerError(f"megatron rank {dead[0] if dead else len(conns)} {what}")
    if errors:
        raise MegatronTrainerError(f"megatron ranks could not connect: {errors[0]}")
    return conns


def _shutdown(conns: list[Any], procs: list[Any], folder: str) -> None:
    for conn in conns:
        if conn is None:
            continue
        try:
            _send(conn, ("close", ()))
        except (OSError, EOFError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for conn in conns:
        if conn is not None:
            conn.close()
    shutil.rmtree(folder, ignore_errors=True)
