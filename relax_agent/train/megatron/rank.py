"""One rank of the Megatron trainer: its process group, model shard, optimizer, and command loop.

Every rank receives the same command with the same arguments (tensor / expert parallelism
without data parallelism: every rank sees the whole batch) and runs it in lockstep; the
collectives inside Megatron's layers line up because the commands do. Rank 0 answers with
the results (gathered Hugging Face weights, metrics); the other ranks answer None, except
for :meth:`RankTrainer.state_dict`, which every rank answers with its own optimizer shard.

The loss path is :class:`~relax_agent.train.backends.torch_backend.TorchTrainer`'s, run on
:class:`~relax_agent.train.megatron.model.MegatronCausalLM`; this class adds what sharding
changes: router replay through Megatron, gradient sums of the norms whose gradient each
rank only holds in part, and the gradient norm over all shards before clipping.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import TrainBatch
from relax_agent.train.config import TrainerConfig
from relax_agent.train.megatron.convert import Parallel, hf_to_rank, model_spec, ranks_to_hf

if TYPE_CHECKING:
    from relax_agent.train.megatron.model import MegatronCausalLM


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs (picklable: it crosses ``spawn``).

    Attributes:
        hf_dir: folder with the policy's Hugging Face ``config.json`` and safetensors weights.
        cfg: the trainer section.
        world_size: ranks (= tensor_parallel; experts spread over the same ranks).
        tensor_parallel, expert_parallel, sequence_parallel: ``trainer.megatron`` sizes.
        init_method: ``tcp://127.0.0.1:PORT`` of the process-group rendezvous.
        device: "cpu" (gloo, CPU patches) or "cuda" (NCCL, rank i on GPU i).
        temperature: the rollout's sampling temperature.
        routing_replay: R3 (MoE policies).
        num_threads: torch intra-op threads per rank.
        seed: torch seed (no dropout; only matters for anything random in Megatron's init).
    """

    hf_dir: str
    cfg: TrainerConfig
    world_size: int
    tensor_parallel: int
    expert_parallel: int
    sequence_parallel: bool
    init_method: str
    device: str = "cpu"
    temperature: float = 1.0
    routing_replay: bool = False
    num_threads: int = 1
    seed: int = 0


def init_parallel(setup: RankSetup, rank: int) -> Parallel:
    """Join the process group, apply the CPU patches when CUDA is absent, and set up Megatron's groups."""
    from relax_agent.train.megatron.cpu import apply_cpu_patches

    backend = "nccl" if setup.device == "cuda" else "gloo"
    if setup.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=setup.init_method, rank=rank, world_size=setup.world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time deprecation / apex notices
        apply_cpu_patches()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ep = setup.expert_parallel
        ps.initialize_model_parallel(setup.tensor_parallel, 1, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=setup.tensor_parallel // ep)
        if setup.device == "cuda":
            model_parallel_cuda_manual_seed(setup.seed)
    return Parallel(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                    ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                    etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank())


def write_hf_folder(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor], tied: bool,
                    generation_config: Path | None = None) -> None:
    """A folder ``from_pretrained`` loads: ``config.json`` and ``model.safetensors``.

    Tensors keep the in-memory Hugging Face names (transformers 5 fuses MoE experts into
    ``experts.gate_up_proj`` / ``experts.down_proj``; ``from_pretrained`` reads those names as
    they are). A tied ``lm_head.weight`` is left out, as ``save_pretrained`` does.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None and generation_config.is_file():
        shutil.copy(generation_config, path / "generation_config.json")


def load_hf_state(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, full state dict) of a Hugging Face folder of safetensors files."""
    from safetensors.torch import load_file

    folder = Path(hf_dir)
    config = json.loads((folder / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return config, state


class RankTrainer(TorchTrainer):
    """:class:`TorchTrainer` on one rank's shard of a Megatron ``GPTModel``.

    Args:
        setup: the run's :class:`RankSetup`.
        rank: this process's global rank.
    """

    model: MegatronCausalLM

    def __init__(self, setup: RankSetup, rank: int) -> None:
        from relax_agent.train.megatron.model import MaskedRouterReplay, MegatronCausalLM, build_gpt_model

        self.setup, self.rank = setup, rank
        self.par = init_parallel(setup, rank)
        self.hf_config, hf_state = load_hf_state(setup.hf_dir)
        self.spec = model_spec(self.hf_config)
        replay = setup.routing_replay and self.spec.is_moe
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gpt = build_gpt_model(self.spec, setup.tensor_parallel, setup.expert_parallel, setup.sequence_parallel, replay)
        gpt.load_state_dict(hf_to_rank(hf_state, self.spec, self.par), strict=True)
        device = torch.device("cuda", rank) if setup.device == "cuda" else torch.device("cpu")
        model = MegatronCausalLM(gpt, self.spec, setup.tensor_parallel, setup.sequence_parallel)
        ref = None
        if setup.cfg.kl_coef > 0:
            ref_gpt = build_gpt_model(self.spec, setup.tensor_parallel, setup.expert_parallel, setup.sequence_parallel, False)
            ref_gpt.load_state_dict(hf_to_rank(hf_state, self.spec, self.par), strict=True)
            ref = MegatronCausalLM(ref_gpt, self.spec, setup.tensor_parallel, setup.sequence_parallel)
        del hf_state
        super().__init__(model, setup.cfg, device=device, ref_model=ref, temperature=setup.temperature)
        sp = setup.sequence_parallel
        self.router_replay = (MaskedRouterReplay(self.spec.num_layers, self.spec.top_k, self.spec.num_experts,
                                                 (self.par.tp_rank, setup.tensor_parallel) if sp else (0, 1))
                              if replay else None)
        self._partial = [p for p in self.params
                         if (sp and getattr(p, "sequence_parallel", False)) or
                         (setup.tensor_parallel > 1 and getattr(p, "tp_partial_grad", False))]
        self._owned = [p for p in self.params if rank == 0 or getattr(p, "tensor_model_parallel", False)
                       or not getattr(p, "allreduce", True)]
        """Parameters whose squared gradient this rank adds to the global norm (each shard once)."""

    # ----------------------------------------------------------------- loss path hooks

    def compute_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """:meth:`TorchTrainer.compute_gradients` on this rank's shard, then the tensor-parallel sum of
        partial gradients; with routing replay, also its MoE metrics (summed over the ranks under
        sequence parallelism)."""
        metrics = super().compute_gradients(batch)
        self._sum_partial_grads()
        if self.router_replay is not None:
            moe = self.router_replay.pop_metrics()
            if self.setup.sequence_parallel:  # each rank routed T / tp positions
                counts = torch.tensor([moe["moe/replayed_tokens"], moe["moe/route_flip_frac"] * moe["moe/replayed_tokens"]],
                                      dtype=torch.float64, device=self.device)
                dist.all_reduce(counts)
                replayed = float(counts[0])
                moe = {"moe/replayed_tokens": replayed, "moe/route_flip_frac": float(counts[1]) / max(replayed, 1)}
            metrics.update(moe)
        return metrics

    def _backward_micro_batch(self, mb: TrainBatch, normalizer: float, totals: Any, prefix_len: int = 0) -> None:
        # prefix_len is always 0 here: the Megatron model's forward takes no KV cache, so the step's
        # micro-batches are never planned around a shared prefix (shared_prefix.can_share).
        with self._replay(mb):
            super()._backward_micro_batch(mb, normalizer, totals, prefix_len)

    def _replay(self, mb: TrainBatch) -> contextlib.AbstractContextManager:
        if self.router_replay is None:
            return contextlib.nullcontext()
        from relax_agent.errors import DataError

        if mb.routed_experts is None or mb.routes_mask is None:  # TrainBatch holds both or neither
            raise DataError("moe.routing_replay=rollout but the batch has no routed_experts: the rollout engine "
                            "did not record routes (build it with record_routes=True)")
        t = mb.input_ids.shape[1]
        padded = t + (-t % self.model.pad_multiple)
        return self.router_replay.replaying(mb.routed_experts, mb.routes_mask, padded)

    def _sum_partial_grads(self) -> None:
        """Sum over the tensor-parallel ranks the gradients each rank holds only in part."""
        if not self._partial:
            return
        from megatron.core import parallel_state as ps

        grads = [p.grad for p in self._partial if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            _unflatten_into(flat, grads)

    def _clip_global(self) -> float:
        """Clip every shard by the global gradient norm (``grad_clip``); returns that norm."""
        grad_norm = self._global_grad_norm()
        if math.isfinite(grad_norm):
            coef = min(1.0, self.cfg.grad_clip / (grad_norm + 1e-6))  # clip_grad_norm_'s rule
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return grad_norm

    def _clip_and_step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            self._agree_on_overflow()
        grad_norm = self._clip_global()
        stepped = math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif stepped:
            self.optimizer.step()
        if stepped:
            self.scheduler.step()
            self.step += 1
        return grad_norm

    def _clip_sft_grads(self) -> float:
        """:meth:`TorchTrainer.sft_step` on the shards: gradients summed where partial, clipped by
        the global norm."""
        self._sum_partial_grads()
        return self._clip_global()

    def _global_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient, every shard counted once (all ranks agree)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._owned:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        return float(sq.sqrt())

    def _agree_on_overflow(self) -> None:
        """fp16: every rank skips the step when any rank's shard overflowed."""
        assert self.scaler is not None  # fp16 runs have a scaler
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found in state["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    # ----------------------------------------------------------------- weights out

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron tensors (detached, on CPU)."""
        return {k: v.detach().cpu() for k, v in self.model.gpt.state_dict().items() if not k.endswith("_extra_state")}

    def gather_hf(self, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """Every rank's shards joined into Hugging Face names on rank 0 (None elsewhere).

        Args:
            grads: gather the parameters' gradients instead of their values (tests).
        """
        if grads:
            named = dict(self.model.gpt.named_parameters())
            local = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu() for k, p in named.items()}
            if self.spec.tied:
                local.pop("output_layer.weight", None)
        else:
            local = self.local_state()
        gathered: list[Any] | None = [None] * self.setup.world_size if self.rank == 0 else None
        dist.gather_object((self.par, local), gathered, dst=0)
        if gathered is None:  # not rank 0
            return None
        return ranks_to_hf(gathered, self.spec)

    def policy_state_dict(self) -> dict[str, torch.Tensor] | None:  # type: ignore[override]  # None off rank 0
        """The full Hugging Face state dict, gathered to rank 0 (None on the other ranks)."""
        return self.gather_hf()

    def save_model(self, path: Path) -> None:
        """Rank 0 writes the policy into ``path`` (:func:`write_hf_folder`)."""
        state = self.gather_hf()
        if state is not None:  # rank 0
            write_hf_folder(Path(path), self.hf_config, state, self.spec.tied,
                            Path(self.setup.hf_dir) / "generation_config.json")

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """[B, T, V] logits (no gradient) on rank 0, for conversion checks."""
        with torch.no_grad():
            out = self.model(input_ids.to(self.device), attention_mask.to(self.device)).logits.cpu()
        return out if self.rank == 0 else None

    def gradients(self, batch: TrainBatch) -> dict[str, Any] | None:
        """The full-batch gradient in Hugging Face names and the step's metrics, without an update (tests)."""
        metrics = self.compute_gradients(batch)
        grads = self.gather_hf(grads=True)
        self.optimizer.zero_grad(set_to_none=True)
        return None if grads is None else {"grads": grads, "metrics": metrics}


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


_COMMANDS = {"train_step", "sft_step", "end_sft", "policy_state_dict", "state_dict", "load_state_dict", "save_model", "logits", "gradients"}


def _send(conn: Any, obj: Any) -> None:
    import pickle

    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    import pickle

    return pickle.loads(conn.recv_bytes())


def rank_main(rank: int, setup: RankSetup, conn: Any) -> None:
    """Process entry point: build the rank's trainer, then answer commands from ``conn`` until "close".

    Protocol: the driver sends ``(command, args)``; the rank replies ``("ok", result)`` or
    ``("error", (exception, traceback text))``; "close" (or the driver's end of the pipe
    closing) ends the process. The first reply, ``("ready", None)``, follows the build.
    """
    torch.set_num_threads(max(1, setup.num_threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        trainer = RankTrainer(setup, rank)
    except BaseException as exc:  # the driver re-raises it with the rank's traceback
        _send(conn, ("error", (_picklable(exc), traceback.format_exc())))
        return
    _send(conn, ("ready", None))
    try:
        while True:
            try:
                command, args = _recv(conn)
            except EOFError:
                break
            if command == "close":
                break
            try:
                assert command in _COMMANDS, command
                result = getattr(trainer, command)(*args)
                _send(conn, ("ok", result))
            except Exception as exc:  # a failed step is reported, the rank stays up
                _send(conn, ("error", (_picklable(exc), traceback.format_exc())))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def main(argv: list[str]) -> int:
    """``python -m relax_agent.train.megatron.rank RANK HOST:PORT SETUP.pkl`` (started by the backend).

    Connects to the driver's listener with the key in ``$RELAX_MEGATRON_AUTHKEY``, sends its
    rank, then runs :func:`rank_main`.
    """
    import pickle
    from multiprocessing.connection import Client

    rank, address, setup_path = int(argv[0]), argv[1], Path(argv[2])
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("RELAX_MEGATRON_AUTHKEY")))
    _send(conn, rank)
    rank_main(rank, pickle.loads(setup_path.read_bytes()), conn)
    conn.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
