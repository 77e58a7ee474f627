"""HF <-> Megatron conversion tables: exact round trips over TP / EP layouts, and refusals naming the key."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relax_agent.errors import ConfigError
from relax_agent.train.config import MegatronConfig, TrainerConfig
from relax_agent.train.megatron.convert import (
    LAYER_TABLES,
    Parallel,
    check_parallel,
    hf_to_rank,
    megatron_names,
    model_spec,
    ranks_to_hf,
)

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=128)
FAMILIES = {
    "llama": dict(head_dim=8, tie_word_embeddings=True),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=8, tie_word_embeddings=False),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


def tiny(family: str, **overrides):
    config = AutoConfig.for_model(family, **{**SMALL, **FAMILIES[family], **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def layouts(spec):
    out = [(1, 1), (2, 1)]
    if spec.is_moe:
        out.append((2, 2))
    return out


def grid(tp: int, ep: int) -> list[Parallel]:
    etp = tp // ep
    return [Parallel(tp, r, ep, r % ep, etp, r // ep) for r in range(tp)]


def test_every_family_has_a_table():
    assert set(LAYER_TABLES) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_inverts_import_exactly_for_every_layout(family):
    model = tiny(family)
    state, spec = model.state_dict(), model_spec(model.config)
    for tp, ep in layouts(spec):
        ranks = [(par, hf_to_rank(state, spec, par)) for par in grid(tp, ep)]
        back = ranks_to_hf(ranks, spec)
        assert back.keys() == state.keys(), (tp, ep)
        for name, value in state.items():
            assert torch.equal(back[name], value), (family, tp, ep, name)


def test_shards_have_megatron_shapes():
    model = tiny("qwen2")
    spec = model_spec(model.config)
    rank1 = hf_to_rank(model.state_dict(), spec, grid(2, 1)[1])
    assert set(rank1) == set(megatron_names(spec))
    assert rank1["embedding.word_embeddings.weight"].shape == (51, 32)  # 101 padded to 102, half each
    assert rank1["embedding.word_embeddings.weight"][-1].abs().sum() == 0  # the padding row
    # one query group per rank: 2 q heads + k + v, head_dim 8
    assert rank1["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (32, 32)
    assert rank1["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (32,)
    assert rank1["decoder.layers.0.mlp.linear_fc1.weight"].shape == (64, 32)  # [gate half; up half]
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_qkv.weight"][:16], q[16:])


def test_expert_parallel_ranks_hold_their_own_experts():
    model = tiny("qwen3_moe")
    spec = model_spec(model.config)
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    rank1 = hf_to_rank(model.state_dict(), spec, grid(2, 2)[1])
    assert len([n for n in rank1 if n.startswith("decoder.layers.1.mlp.experts.")]) == 2 * 2  # 2 local experts
    assert torch.equal(rank1["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"], gate_up[2])


def test_router_normalisation_maps_to_pre_softmax():
    from relax_agent.train.megatron.convert import transformer_config_kwargs

    assert transformer_config_kwargs(model_spec(tiny("qwen3_moe").config))["moe_router_pre_softmax"] is False
    olmoe_like = tiny("qwen3_moe", norm_topk_prob=False)
    assert transformer_config_kwargs(model_spec(olmoe_like.config))["moe_router_pre_softmax"] is True
    assert model_spec(tiny("mixtral").config).renormalize


@pytest.mark.parametrize("overrides, key", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unmapped_features_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key):
        model_spec(tiny("llama", **overrides).config)


def test_unsupported_family_names_the_backend():
    with pytest.raises(ConfigError, match="trainer.backend=torch"):
        model_spec({"model_type": "gpt2"})


def test_layouts_that_do_not_divide_the_model_name_the_key():
    spec = model_spec(tiny("llama").config)
    with pytest.raises(ConfigError, match="tensor_parallel=3 must divide the policy's num_attention_heads=4"):
        check_parallel(spec, 3, 1)
    with pytest.raises(ConfigError, match="expert_parallel=2 needs an MoE policy"):
        check_parallel(spec, 2, 2)
    with pytest.raises(ConfigError, match="num_experts=3"):
        check_parallel(model_spec(tiny("qwen3_moe", num_experts=3).config), 2, 2)


def test_megatron_section_validates_its_layout():
    cfg = TrainerConfig(backend="megatron", megatron={"tensor_parallel": 2, "sequence_parallel": True})
    assert cfg.megatron.world_size == 2
    for bad, match in ((dict(pipeline_parallel=2), "pipeline_parallel=2: only 1"),
                       (dict(sequence_parallel=True), "sequence_parallel needs tensor_parallel > 1"),
                       (dict(tensor_parallel=2, expert_parallel=4), "expert_parallel=4 must divide")):
        with pytest.raises(ValueError, match=match):
            MegatronConfig(**bad)
