"""Routing replay in the server (``--record-routes``): per sampled token, the experts each MoE
layer chose; and the refusal (exit code :data:`EX_CONFIG`) of a set-up that cannot record them."""

import os
import sys
from typing import Any

from work_items import _Req

EX_CONFIG = 78
"""Exit code of a refused set-up (the client turns it into a ConfigError)."""
_ROUTES = "moe.routing_replay=rollout (--record-routes)"


def refuse(message: str) -> None:
    """Exit with :data:`EX_CONFIG` and ``message`` on stderr (a set-up that cannot work)."""
    print(f"vllm_server: {message}", file=sys.stderr, flush=True)
    os._exit(EX_CONFIG)  # not sys.exit: a thread vLLM started must not keep the process alive


def _batch_layout(worker: Any) -> tuple[list[str], Any]:
    """(request ids, ``query_start_loc`` [n + 1]) of the V1 model runner's latest forward pass."""
    runner = worker.model_runner
    n = runner.input_batch.num_reqs
    return list(runner.input_batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].copy()


class RouteCapture:
    """Per sampled token, the experts each MoE layer chose in the forward pass that scored it.

    vLLM's ``bind_routed_experts_capturer`` makes every MoE layer's router call
    :meth:`capture` with its ``topk_ids`` [N, top_k] (N = tokens of the step, all requests
    concatenated). After a step, the V1 model runner's ``query_start_loc`` says which rows
    were each request's: request ``i``'s last row ``qsl[i + 1] - 1`` is the position whose
    logits sampled its new token, i.e. the row for input position ``P - 1 + j`` when it
    samples its ``j``-th token (``P`` = prompt length), the Hugging Face engine's convention.
    A resumed request (``abort_resume``) prefills prompt + its tokens again and keeps
    appending, so a reply holds one row per token over all attempts.

    This reads V1-runner internals (``model_runner.input_batch.req_ids``,
    ``model_runner.query_start_loc``) and needs one sampled token per request per step, so
    it refuses (:func:`refuse`) async scheduling, speculative decoding and parallelism.

    Attributes:
        layers: vLLM layer ids of the MoE layers, ascending (dense layers report nothing).
        top_k: experts per token.
        dtype: numpy dtype of the routes: uint8 up to 256 experts, int16 up to 32768, else int32.
    """

    def __init__(self, llm: Any) -> None:
        import numpy as np
        import torch
        import vllm

        self.llm = llm
        self.version = vllm.__version__
        config = llm.vllm_config
        par = config.parallel_config
        why = None
        if config.scheduler_config.async_scheduling:
            why = "async scheduling is on (it overlaps a step's forward with the previous step's outputs)"
        elif config.speculative_config is not None:
            why = "speculative decoding is on (a step can sample several tokens per request)"
        elif (par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size) != (1, 1, 1):
            why = (f"parallelism tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size} "
                   f"dp={par.data_parallel_size} (expected 1, 1, 1)")
        if why:
            refuse(f"{_ROUTES}: {why}; routes are recorded only with synchronous scheduling, no "
                   f"speculative decoding and one worker (vllm {self.version})")
        experts = int(config.model_config.get_num_experts())
        if experts <= 0:
            refuse(f"{_ROUTES}: this {config.model_config.hf_text_config.model_type} model has no experts "
                   f"(vllm {self.version})")
        self.dtype = np.dtype(np.uint8 if experts <= 256 else np.int16 if experts <= 32768 else np.int32)
        self._torch_dtype = torch.from_numpy(np.empty(0, dtype=self.dtype)).dtype
        self.top_k = int(config.model_config.get_num_experts_per_tok())
        self.layers: list[int] = []
        self._latest: dict[int, Any] = {}
        try:
            self.bind()
        except ValueError as exc:
            refuse(f"{_ROUTES}: vllm {self.version} cannot capture this model's routes: {exc}")

    def bind(self) -> None:
        """Point every MoE router's capture callback at :meth:`capture` (again after a weight reload).

        Raises:
            ValueError: vLLM found no MoE router it can capture.
        """
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        self.llm.apply_model(lambda model: bind_routed_experts_capturer(model, self))

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        """Called by vLLM in the forward pass: layer ``layer_id``'s experts [N, top_k]."""
        self._latest[layer_id] = topk_ids.detach().to(self._torch_dtype, copy=True)

    def check(self) -> None:
        """After a first forward pass (the warm-up): learn the MoE layer ids, and refuse a vLLM
        whose model runner does not expose the batch layout this class reads."""
        self.layers = sorted(self._latest)
        if not self.layers:
            refuse(f"{_ROUTES}: no MoE layer reported routes in a forward pass (vllm {self.version})")
        try:
            self.llm.collective_rpc(_batch_layout)
        except AttributeError as exc:
            refuse(f"{_ROUTES} reads the V1 model runner's input_batch.req_ids and query_start_loc, "
                   f"which vllm {self.version} does not have ({exc}); use engine.kind=hf for routing replay")

    def start_step(self) -> None:
        """Forget the routes of the previous forward pass (called before each model step)."""
        self._latest = {}

    def step_routes(self) -> tuple[dict[str, int], Any]:
        """After ``llm.step()``: (vLLM request id -> its last row, [N, layers, top_k] routes of the step).

        Raises:
            RuntimeError: a MoE layer did not report routes in this step.
        """
        import torch

        missing = [layer for layer in self.layers if layer not in self._latest]
        if missing:
            raise RuntimeError(f"MoE layers {missing} reported no routes in this step (vllm {self.version})")
        ids, qsl = self.llm.collective_rpc(_batch_layout)[0]
        routes = torch.stack([self._latest[layer] for layer in self.layers], dim=1).cpu().numpy()
        return {rid: int(qsl[i + 1]) - 1 for i, rid in enumerate(ids)}, routes

    @staticmethod
    def row_of(req: _Req, last_rows: dict[str, int]) -> int:
        """The row of ``req``'s last position in the step (RuntimeError when it was not in the batch)."""
        row = last_rows.get(req.engine_id) if req.engine_id is not None else None
        if row is None:  # vLLM adds "-<random>" to the id it was given
            row = next((r for rid, r in last_rows.items() if rid.startswith(f"{req.vllm_id}-")), None)
        if row is None:
            raise RuntimeError(f"request {req.vllm_id} sampled a token but is not in the step's batch "
                               f"{sorted(last_rows)}")
        return row
