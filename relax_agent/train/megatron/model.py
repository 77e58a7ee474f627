"""A Megatron ``GPTModel`` behind the causal-LM forward the trainer's loss path calls, and R3 replay.

:class:`MegatronCausalLM` takes ``input_ids`` / ``attention_mask`` [B, T] and returns ``.logits``
[B, T, V] gathered over the tensor-parallel ranks (vocabulary padding dropped), so
:func:`relax_agent.train.backends.torch_backend.token_logprobs_and_entropy` and the GRPO loss
run unchanged on every rank. Inside, Megatron works sequence-first ([T, B, H]); the
attention mask is causal plus key padding ([B, 1, T, T], True = masked), and with sequence
parallelism T is padded to a multiple of the tensor-parallel size.

Routing replay (R3) uses Megatron's own hook, ``RouterReplay`` (``moe_enable_routing_replay``):
each MoE layer's router asks its ``RouterReplay`` for the top-k experts. :class:`MaskedRouterReplay`
answers with the rollout's experts at the replayed positions and with the router's own top-k
elsewhere, the same rule as :mod:`relax_agent.moe.replay` for Hugging Face models; the gate
weights come from the router's scores at those experts, so the router still learns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from relax_agent.errors import DataError
from relax_agent.moe.replay import REPLAYED_TOKENS, ROUTE_FLIP_FRAC, forward_position_routes
from relax_agent.train.megatron.convert import ModelSpec, transformer_config_kwargs


@dataclass
class Output:
    """``logits`` [B, T, V] float (the Hugging Face ``CausalLMOutput`` field the loss path reads)."""

    logits: torch.Tensor


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor, usable under sequence parallelism.

    Megatron's own torch fallback (``WrappedTorchNorm``) refuses ``sequence_parallel``; the
    math does not care, only the gradient does: under sequence parallelism each rank sees
    ``T / tp`` positions, so the weight is marked ``sequence_parallel`` and the trainer sums
    its gradient over the tensor-parallel ranks (as Megatron's DDP does for its own norms).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))  # noqa: B010 -- Megatron's parameter tag, an attribute torch's Parameter type does not declare


class QKNorm(nn.RMSNorm):
    """Per-head RMSNorm of queries / keys (Qwen3). Each tensor-parallel rank holds only its own
    heads, so its weight gradient is a partial sum: the weight is marked ``tp_partial_grad``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "tp_partial_grad", True)  # noqa: B010 -- our tag, an attribute torch's Parameter type does not declare


def build_gpt_model(spec: ModelSpec, tp: int, ep: int, sequence_parallel: bool, routing_replay: bool) -> nn.Module:
    """A local-spec Megatron ``GPTModel`` for ``spec`` on this rank (weights uninitialised; load them).

    Needs ``megatron.core.parallel_state`` initialised with the same sizes. Norms are
    :class:`RMSNorm` / :class:`QKNorm` (Megatron's torch fallback refuses sequence parallelism).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = transformer_config_kwargs(spec)
    kw.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, sequence_parallel=sequence_parallel)
    if spec.is_moe:
        kw.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp // ep,
                  moe_enable_routing_replay=routing_replay)
    config = TransformerConfig(**kw)
    layer = get_gpt_layer_local_spec(num_experts=spec.num_experts or None, qk_layernorm=config.qk_layernorm,
                                     normalization="RMSNorm")
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        layer.submodules.self_attention.submodules.q_layernorm = QKNorm
        layer.submodules.self_attention.submodules.k_layernorm = QKNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * spec.num_layers, layer_norm=RMSNorm)
    gpt = GPTModel(config, block, vocab_size=spec.padded_vocab(tp), max_sequence_length=spec.max_positions,
                   parallel_output=False, share_embeddings_and_output_weights=spec.tied,
                   position_embedding_type="rope", rotary_base=int(spec.rope_theta), rotary_percent=1.0)
    tag_sharded_weights(gpt)
    return gpt


def tag_sharded_weights(gpt: nn.Module) -> None:
    """Mark the weights of Megatron's tensor-parallel layers as sharded (``tensor_model_parallel``).

    Megatron tags them only when it initialises them (``perform_initialization``); the weights here
    are loaded instead, so without this every rank but 0 would leave its shards out of the global
    gradient norm (clipping at TP > 1 would see a smaller norm than the torch backend's).
    Column-parallel and vocab-parallel weights are split along dim 0, row-parallel along dim 1.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in gpt.modules():
        if isinstance(module, RowParallelLinear):
            dim = 1
        elif isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


class MegatronCausalLM(nn.Module):
    """``GPTModel`` with the Hugging Face causal-LM call signature.

    Args:
        gpt: from :func:`build_gpt_model`.
        spec: the model's :class:`ModelSpec` (vocabulary size to cut the padding off).
        tp: tensor-parallel size (sequence lengths are padded to a multiple of it with
            sequence parallelism).
        sequence_parallel: the model was built with ``sequence_parallel``.
    """

    def __init__(self, gpt: Any, spec: ModelSpec, tp: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.gpt = gpt
        self.spec = spec
        self.config = gpt.config
        self.pad_multiple = tp if sequence_parallel else 1
        self.replay: MaskedRouterReplay | None = None

    def get_input_embeddings(self) -> nn.Module:
        """The word-embedding module (Hugging Face's accessor; LoRA and tied-weight code look it up)."""
        return self.gpt.embedding.word_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False) -> Output:
        """Logits [B, T, V] of ``input_ids`` [B, T] (right padded; ``attention_mask`` [B, T] 1 on real tokens)."""
        b, t = input_ids.shape
        pad = -t % self.pad_multiple
        if pad:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b, pad)], dim=1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(b, pad)], dim=1)
        n = t + pad
        positions = torch.arange(n, device=input_ids.device).expand(b, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).triu(1)
        masked = causal[None, None] | ~attention_mask.bool()[:, None, None, :]
        logits = self.gpt(input_ids=input_ids, position_ids=positions, attention_mask=masked)
        return Output(logits[:, :t, :self.spec.vocab_size])


def _megatron_router_replay() -> Any:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


class MaskedRouterReplay:
    """R3 through Megatron's ``RouterReplay``: replayed experts where recorded, own top-k elsewhere.

    Built after the model (whose routers created one ``RouterReplay`` each, in layer order).
    Inside :meth:`replaying` every forward must be over the batch given to it.

    Args:
        num_layers: MoE layers of the model; must equal the number of ``RouterReplay`` instances.
        top_k, num_experts: the routers' k and E.
        seq_shard: (rank, size) of the sequence-parallel split the routers see (size 1 without
            sequence parallelism): each router scores the rows ``[T/size * rank, T/size * (rank + 1))``.

    Raises:
        DataError: the model has no (or a different number of) replaying routers.
    """

    def __init__(self, num_layers: int, top_k: int, num_experts: int, seq_shard: tuple[int, int]) -> None:
        replay_cls = _megatron_router_replay()
        instances = list(replay_cls.global_router_replay_instances)
        if len(instances) != num_layers:
            raise DataError(f"found {len(instances)} Megatron RouterReplay instances for {num_layers} MoE layers")
        self.top_k, self.num_experts, self.seq_shard = top_k, num_experts, seq_shard
        self._forced: torch.Tensor | None = None  # [layers, rows, k]
        self._mask: torch.Tensor | None = None  # [rows]
        self._counted: set[int] = set()
        self._replayed, self._flipped = 0.0, 0.0
        for layer, inst in enumerate(instances):
            inst.get_replay_topk = self._topk(layer)

    def _topk(self, layer: int) -> Any:
        def topk(scores: torch.Tensor, k: int, num_groups: Any = None, group_topk: Any = None,
                 default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            own_scores, own = default_compute_topk(scores, k, num_groups=num_groups, group_topk=group_topk)
            if self._forced is None or self._mask is None:  # set and cleared together
                return own_scores, own
            if scores.shape[0] != self._mask.shape[0]:
                raise DataError(f"a Megatron router saw {scores.shape[0]} tokens but the replayed batch has "
                                f"{self._mask.shape[0]} on this rank; forward only that batch inside replaying()")
            forced, mask = self._forced[layer].to(own.device), self._mask.to(own.device)[:, None]
            if layer not in self._counted:
                self._counted.add(layer)
                with torch.no_grad():
                    differs = (own.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
                    self._flipped += float((differs & mask[:, 0]).sum())
                    self._replayed += float(mask.sum())
            indices = torch.where(mask, forced, own)
            return scores.gather(1, indices), indices

        return topk

    @contextlib.contextmanager
    def replaying(self, routed_experts: torch.Tensor, routes_mask: torch.Tensor, padded_len: int) -> Iterator[None]:
        """Replay token-aligned routes [B, T, layers, k] (``routes_mask`` [B, T]) inside the block.

        ``padded_len`` is the sequence length the model forwards (T plus sequence-parallel padding).

        Raises:
            DataError: the routes do not fit the model (layers, k, expert ids).
        """
        b, t, layers, k = routed_experts.shape
        if k != self.top_k or routed_experts.dim() != 4:
            raise DataError(f"routed_experts must be [B, T, layers, top_k={self.top_k}]; got {tuple(routed_experts.shape)}")
        if routed_experts.numel() and int(routed_experts.max()) >= self.num_experts:
            raise DataError(f"routed_experts holds expert id {int(routed_experts.max())}; this model has "
                            f"{self.num_experts} experts per layer")
        experts, mask = forward_position_routes(routed_experts, routes_mask)
        pad = padded_len - t
        if pad:
            experts = torch.cat([experts, experts.new_zeros(b, pad, layers, k)], dim=1)
            mask = torch.cat([mask, mask.new_zeros(b, pad)], dim=1)
        rank, size = self.seq_shard
        rows = slice(padded_len // size * rank, padded_len // size * (rank + 1))
        # Megatron is sequence-first: router row index = s * B + b.
        self._forced = experts[:, rows].transpose(0, 1).reshape(-1, layers, k).permute(1, 0, 2).contiguous()
        self._mask = mask[:, rows].transpose(0, 1).reshape(-1)
        self._counted = set()
        try:
            yield
        finally:
            self._forced, self._mask = None, None

    def pop_metrics(self) -> dict[str, float]:
        """``moe/replayed_tokens`` (this rank's positions) and ``moe/route_flip_frac`` since the last call."""
        layers = max(len(_megatron_router_replay().global_router_replay_instances), 1)
        out = {REPLAYED_TOKENS: self._replayed / layers, ROUTE_FLIP_FRAC: self._flipped / max(self._replayed, 1.0)}
        self._replayed, self._flipped = 0.0, 0.0
        return out
