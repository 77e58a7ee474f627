"""Hugging Face <-> Megatron ``GPTModel``: configs, and weights split into (and joined from) shards.

One table per family maps each Megatron parameter (of the local-spec ``GPTModel``: no
Transformer Engine fusion) to its Hugging Face tensor(s) and a layout rule. Per layer ``i``
the Megatron names are ``decoder.layers.{i}.<suffix>``, the Hugging Face names
``model.layers.{i}.<name>``. Rules (``t`` = tensor-parallel size, ``r`` = rank; ``u``/``s`` =
expert-tensor-parallel size/rank):

- ``COPY``: replicated on every rank (norms, router).
- ``VOCAB``: rows of the vocabulary, padded with zero rows to a multiple of ``t``, chunk ``r``.
- ``COL``: input columns chunk ``r`` (row-parallel linears: ``o_proj``, ``down_proj``).
- ``QKV``: ``q``/``k``/``v`` interleaved per query group, ``[groups, q_per_group + 2, head_dim, H]``,
  groups chunk ``r`` (Megatron's fused ``linear_qkv`` layout); the same for the biases.
- ``GATE_UP``: ``[gate chunk r; up chunk r]`` (Megatron's gated ``linear_fc1``).
- ``EXPERT_GATE_UP`` / ``EXPERT_DOWN``: Hugging Face's fused ``experts.gate_up_proj``
  [E, 2I, H] / ``experts.down_proj`` [E, H, I]; Megatron's ``local_experts.{j}`` on
  expert-parallel rank ``e`` is global expert ``e * E / ep + j``, split by ``u``/``s`` like
  ``GATE_UP`` / ``COL``.

Export (:func:`ranks_to_hf`) is the exact inverse: it joins the shards of every rank and drops
the vocabulary padding, so ``ranks_to_hf(hf_to_rank(sd, ...) for every rank) == sd``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from relax_agent.errors import ConfigError

COPY, VOCAB, COL, QKV, GATE_UP, EXPERT_GATE_UP, EXPERT_DOWN = (
    "copy", "vocab", "col", "qkv", "gate_up", "expert_gate_up", "expert_down")

_ATTENTION = {
    "input_layernorm.weight": ("input_layernorm.weight", COPY),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), QKV),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", COL),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", COPY),
}
_QKV_BIAS = {
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                        "self_attn.v_proj.bias"), QKV),
}
_QK_NORM = {
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", COPY),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", COPY),
}
_DENSE_MLP = {
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", COL),
}
_MOE_MLP = {
    "mlp.router.weight": ("mlp.gate.weight", COPY),
    "mlp.experts.local_experts.{j}.linear_fc1.weight": ("mlp.experts.gate_up_proj", EXPERT_GATE_UP),
    "mlp.experts.local_experts.{j}.linear_fc2.weight": ("mlp.experts.down_proj", EXPERT_DOWN),
}

LLAMA = {**_ATTENTION, **_DENSE_MLP}
"""Llama / SmolLM2: GQA, SwiGLU, RMSNorm, no biases."""
QWEN2 = {**_ATTENTION, **_QKV_BIAS, **_DENSE_MLP}
"""Qwen2 / Qwen2.5: Llama plus q/k/v biases."""
QWEN3 = {**_ATTENTION, **_QK_NORM, **_DENSE_MLP}
"""Qwen3: Llama plus per-head RMSNorm on queries and keys."""
QWEN3_MOE = {**_ATTENTION, **_QK_NORM, **_MOE_MLP}
"""Qwen3-MoE: Qwen3 attention, top-k softmax router, SwiGLU experts, no shared expert."""
MIXTRAL = {**_ATTENTION, **_MOE_MLP}
"""Mixtral: Llama attention, top-k router renormalised over the chosen experts."""

LAYER_TABLES: dict[str, dict[str, tuple[Any, str]]] = {
    "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL,
}
"""``config.model_type`` -> its per-layer table (Megatron suffix -> (Hugging Face name(s), rule))."""

_TOP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", VOCAB),
    "decoder.final_layernorm.weight": ("model.norm.weight", COPY),
}
_OUTPUT = {"output_layer.weight": ("lm_head.weight", VOCAB)}


@dataclass(frozen=True)
class Parallel:
    """One rank's place in the tensor / expert grid.

    Attributes:
        tp, tp_rank: tensor-parallel size and rank (dense weights and the vocabulary).
        ep, ep_rank: expert-parallel size and rank (which experts the rank holds).
        etp, etp_rank: expert-tensor-parallel size and rank (how each expert is split).
    """

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """What the conversion needs to know about a Hugging Face causal LM config.

    Attributes:
        family: ``config.model_type`` (a key of :data:`LAYER_TABLES`).
        num_layers, hidden_size, num_heads, num_query_groups, head_dim: attention shape.
        ffn_hidden_size: dense MLP width (``intermediate_size``).
        vocab_size: V, the Hugging Face vocabulary (before padding to the tensor-parallel size).
        tied: the output layer shares the input embedding.
        num_experts, top_k, moe_ffn_hidden_size: MoE only (0 for dense models).
        renormalize: MoE: top-k probabilities divided by their sum (``norm_topk_prob``, Mixtral).
        rope_theta, norm_eps, max_positions: as in the Hugging Face config.
    """

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    rope_theta: float
    norm_eps: float
    max_positions: int
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden_size: int = 0
    renormalize: bool = True

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts (``num_experts > 0``)."""
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        """V rounded up to a multiple of ``tp`` (Megatron splits the vocabulary evenly)."""
        return -(-self.vocab_size // tp) * tp

    def table(self) -> dict[str, tuple[Any, str]]:
        """The per-layer conversion table of this model family (:data:`LAYER_TABLES`)."""
        return LAYER_TABLES[self.family]


def model_spec(hf_config: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face config (``PretrainedConfig`` or its ``to_dict()``).

    Raises:
        ConfigError: a family without a table here, or a feature this conversion does not map
            (rope scaling, sliding windows, biases Llama/Qwen3 do not have, dense layers
            inside a Qwen3-MoE, a non-SiLU activation); the message names the config key.
    """
    c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    family = c.get("model_type", "")
    if family not in LAYER_TABLES:
        raise ConfigError(f"trainer.backend=megatron converts the model types {sorted(LAYER_TABLES)}; "
                          f"this policy is {family!r} (use trainer.backend=torch)")
    _refuse(c, family)
    heads = int(c["num_attention_heads"])
    rope: Mapping[str, Any] = c.get("rope_parameters") or {}
    spec = dict(
        family=family, num_layers=int(c["num_hidden_layers"]), hidden_size=int(c["hidden_size"]),
        num_heads=heads, num_query_groups=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        ffn_hidden_size=int(c.get("intermediate_size") or 0), vocab_size=int(c["vocab_size"]),
        tied=bool(c.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), max_positions=int(c.get("max_position_embeddings", 4096)),
    )
    if family in ("qwen3_moe", "mixtral"):
        num_experts = c.get("num_experts") or c.get("num_local_experts")
        if num_experts is None:
            raise ConfigError(f"{family} config has neither num_experts nor num_local_experts")
        experts = int(num_experts)
        width = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        renorm = True if family == "mixtral" else bool(c.get("norm_topk_prob", False))
        spec.update(num_experts=experts, top_k=int(c["num_experts_per_tok"]), moe_ffn_hidden_size=width,
                    renormalize=renorm)
    return ModelSpec(**spec)


def _refuse(c: Mapping[str, Any], family: str) -> None:
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
        raise ConfigError(f"the policy's rope_parameters {rope or c.get('rope_scaling')} use scaling; the megatron "
                          "backend maps rope_type='default' only (use trainer.backend=torch)")
    if c.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={c.get('hidden_act')!r}: the megatron backend maps SwiGLU (silu) MLPs only")
    if c.get("use_sliding_window") or (family == "mixtral" and c.get("sliding_window")):
        raise ConfigError("the policy uses sliding-window attention (use_sliding_window / sliding_window); "
                          "the megatron backend maps full attention only")
    if family in ("llama", "qwen3", "mixtral") and (c.get("attention_bias") or c.get("mlp_bias")):
        raise ConfigError(f"{family} with attention_bias/mlp_bias is not mapped by the megatron backend")
    if family == "qwen3_moe" and (c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1):
        raise ConfigError(f"qwen3_moe with dense layers (mlp_only_layers={c.get('mlp_only_layers')}, "
                          f"decoder_sparse_step={c.get('decoder_sparse_step')}) is not mapped by the megatron backend")


def check_parallel(spec: ModelSpec, tp: int, ep: int) -> None:
    """Refuse sizes that do not divide the model.

    Raises:
        ConfigError: naming ``trainer.megatron.tensor_parallel`` / ``expert_parallel`` and the
            model dimension it must divide.
    """
    for name, value in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_query_groups),
                        ("intermediate_size", spec.ffn_hidden_size if not spec.is_moe else tp)):
        if value % tp:
            raise ConfigError(f"trainer.megatron.tensor_parallel={tp} must divide the policy's {name}={value}")
    if ep > 1 and not spec.is_moe:
        raise ConfigError(f"trainer.megatron.expert_parallel={ep} needs an MoE policy; {spec.family} is dense")
    if spec.is_moe:
        if spec.num_experts % ep:
            raise ConfigError(f"trainer.megatron.expert_parallel={ep} must divide the policy's "
                              f"num_experts={spec.num_experts}")
        if tp % ep:
            raise ConfigError(f"trainer.megatron.expert_parallel={ep} must divide tensor_parallel={tp} "
                              "(experts are spread over the tensor-parallel ranks)")
        etp = tp // ep
        if spec.moe_ffn_hidden_size % etp:
            raise ConfigError(f"tensor_parallel / expert_parallel = {etp} must divide the policy's expert width "
                              f"{spec.moe_ffn_hidden_size}")


def transformer_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """Model-shape keyword arguments of Megatron's ``TransformerConfig`` for ``spec`` (no parallel sizes).

    Dropout is 0 and every fusion that needs CUDA or Transformer Engine is off; the router is
    Megatron's ``TopKRouter`` with softmax scores, no auxiliary loss, and ``pre_softmax`` set so
    that its top-k weights equal the family's (``renormalize`` False: ``softmax(logits)[S]``;
    True: softmax over the top-k logits).
    """
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size or None,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.family == "qwen2", qk_layernorm=spec.family in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
    )
    if spec.is_moe:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.top_k,
                  moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_pre_softmax=not spec.renormalize,
                  moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_dtype="fp32")
    return kw


def megatron_names(spec: ModelSpec, ep: int = 1) -> list[str]:
    """Megatron parameter names of one rank (``local_experts.{j}`` for ``j < num_experts / ep``)."""
    names = list(_TOP) + ([] if spec.tied else list(_OUTPUT))
    for i in range(spec.num_layers):
        for suffix in spec.table():
            if "{j}" in suffix:
                names += [f"decoder.layers.{i}.{suffix.format(j=j)}" for j in range(spec.num_experts // ep)]
            else:
                names.append(f"decoder.layers.{i}.{suffix}")
    return names


_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _entry(spec: ModelSpec, name: str) -> tuple[Any, str, int | None, int | None]:
    """(hf name(s), rule, layer, local expert) of a Megatron parameter name."""
    table = {**_TOP, **_OUTPUT}
    if name in table:
        hf, rule = table[name]
        return hf, rule, None, None
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        raise KeyError(name)
    layer, suffix = int(m.group(1)), m.group(2)
    e = _EXPERT.search(suffix)
    key = _EXPERT.sub("local_experts.{j}.", suffix) if e else suffix
    hf, rule = spec.table()[key]
    prefix = f"model.layers.{layer}."
    names = tuple(prefix + h for h in hf) if isinstance(hf, tuple) else prefix + hf
    return names, rule, layer, int(e.group(1)) if e else None


def hf_to_rank(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec, par: Parallel) -> dict[str, torch.Tensor]:
    """One rank's Megatron tensors (contiguous copies) from a Hugging Face state dict.

    Args:
        hf_state: full Hugging Face tensors (``model.state_dict()`` or a safetensors file).
        spec: from :func:`model_spec`.
        par: the rank's place in the grid.

    Returns:
        Megatron name -> local shard, for every name of :func:`megatron_names`.
    """
    out = {}
    for name in megatron_names(spec, par.ep):
        hf, rule, _layer, j = _entry(spec, name)
        out[name] = _split(spec, par, rule, hf, hf_state, j).contiguous().clone()
    return out


def _chunk(x: torch.Tensor, n: int, i: int, dim: int = 0) -> torch.Tensor:
    return x.chunk(n, dim=dim)[i]


def _split(spec: ModelSpec, par: Parallel, rule: str, hf: Any, sd: Mapping[str, torch.Tensor],
           j: int | None) -> torch.Tensor:
    t, r = par.tp, par.tp_rank
    if rule == COPY:
        return sd[hf]
    if rule == VOCAB:
        w = sd[hf]
        pad = spec.padded_vocab(t) - w.shape[0]
        return _chunk(torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w, t, r)
    if rule == COL:
        return _chunk(sd[hf], t, r, dim=1)
    if rule == QKV:
        return _chunk(_qkv_join(spec, *(sd[h] for h in hf)), t, r)
    if rule == GATE_UP:
        return torch.cat([_chunk(sd[hf[0]], t, r), _chunk(sd[hf[1]], t, r)])
    assert j is not None  # only expert rules are left, and _entry names their local expert
    expert = par.ep_rank * (spec.num_experts // par.ep) + j
    w = sd[hf][expert]
    if rule == EXPERT_GATE_UP:
        gate, up = w.chunk(2)
        return torch.cat([_chunk(gate, par.etp, par.etp_rank), _chunk(up, par.etp, par.etp_rank)])
    assert rule == EXPERT_DOWN, rule
    return _chunk(w, par.etp, par.etp_rank, dim=1)


def _qkv_join(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[groups * (q_per_group + 2) * head_dim, ...] from HF's separate q, k, v (weights or biases)."""
    g, d, qpg = spec.num_query_groups, spec.head_dim, spec.num_heads // spec.num_query_groups
    rest = q.shape[1:]
    parts = [q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (qpg + 2) * d, *rest)


def _qkv_split(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, qpg = spec.num_query_groups, spec.head_dim, spec.num_heads // spec.num_query_groups
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (qpg + 2) * d, *rest)
    q, k, v = x.split([qpg * d, d, d], dim=1)
    return q.reshape(g * qpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def ranks_to_hf(ranks: Iterable[tuple[Parallel, Mapping[str, torch.Tensor]]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Join every rank's Megatron tensors into Hugging Face names (the inverse of :func:`hf_to_rank`).

    Args:
        ranks: ``(place, local tensors)`` of every rank (replicas are read once).
        spec: from :func:`model_spec`.

    Returns:
        The Hugging Face state dict, with ``lm_head.weight`` (the embedding when tied), in the
        key order of the Hugging Face model's ``state_dict()`` up to layer grouping.
    """
    ranks = list(ranks)
    by_tp = {p.tp_rank: sd for p, sd in reversed(ranks)}
    by_expert = {(p.ep_rank, p.etp_rank): sd for p, sd in reversed(ranks)}
    first = ranks[0][0]
    tps = [by_tp[i] for i in range(first.tp)]
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in megatron_names(spec, first.ep):
        hf, rule, _layer, j = _entry(spec, name)
        if rule in (EXPERT_GATE_UP, EXPERT_DOWN):
            assert j is not None  # _entry names the local expert of an expert rule
            local = spec.num_experts // first.ep
            for e in range(first.ep):
                pieces = [by_expert[(e, s)][name] for s in range(first.etp)]
                if rule == EXPERT_GATE_UP:
                    halves = [p.chunk(2) for p in pieces]
                    w = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
                else:
                    w = torch.cat(pieces, dim=1)
                experts.setdefault(hf, {})[e * local + j] = w
            continue
        pieces = [sd[name] for sd in tps]
        if rule == COPY:
            out[hf] = pieces[0]
        elif rule == VOCAB:
            out[hf] = torch.cat(pieces)[:spec.vocab_size]
        elif rule == COL:
            out[hf] = torch.cat(pieces, dim=1)
        elif rule == QKV:
            for h, x in zip(hf, _qkv_split(spec, torch.cat(pieces)), strict=True):
                out[h] = x
        else:
            assert rule == GATE_UP, rule
            halves = [p.chunk(2) for p in pieces]
            out[hf[0]] = torch.cat([h[0] for h in halves])
            out[hf[1]] = torch.cat([h[1] for h in halves])
    for hf, by_index in experts.items():
        out[hf] = torch.stack([by_index[e] for e in range(spec.num_experts)])
    if spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
