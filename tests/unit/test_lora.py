"""LoRA in the torch trainer: only adapters train, everyone else sees merged weights, resume is exact.

The merge is checked against peft's own ``merge_and_unload`` (the reference implementation)."""

from __future__ import annotations

import copy

import pytest
import torch

from relax_agent.config import TrainerConfig, load_config
from relax_agent.errors import CheckpointError, ConfigError
from relax_agent.train.backends.torch_backend import TorchTrainer
from tests.unit.test_torch_trainer import make_batch, rollout_batch, tiny_llama

peft = pytest.importorskip("peft")

LORA = {"rank": 4, "alpha": 8.0}


def cfg(**lora) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, micro_batch_size=8, grad_clip=1.0, lora={**LORA, **lora})


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def trained(steps: int = 2, seed: int = 0) -> TorchTrainer:
    base = tiny_llama(seed)
    trainer = TorchTrainer(base, cfg())
    batch = make_batch(rollout_batch(tiny_llama(seed), n=8, seed=1))
    for _ in range(steps):
        trainer.train_step(batch)
    return trainer


def test_only_the_adapters_train_and_adam_keeps_state_for_them_alone():
    base = tiny_llama()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    trainer = TorchTrainer(base, cfg())
    n_base = sum(t.numel() for t in before.values())
    n_trainable = sum(p.numel() for p in trainer.params)
    # r (in + out) per projection, r = 4: q, o 32->32; k, v 32->16; gate, up 32->64; down 64->32; 2 layers
    assert n_trainable == 2 * 4 * (2 * 64 + 2 * 48 + 3 * 96) == 4096 < n_base / 6
    trainer.train_step(make_batch(rollout_batch(tiny_llama(), n=8, seed=1)))
    state = trainer.optimizer.state_dict()["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == n_trainable
    now = trainer.model.state_dict()
    for key, value in before.items():  # base weights untouched
        live = now.get(key, now.get(key.replace(".weight", ".base_layer.weight")))
        assert torch.equal(live, value), key


def test_merged_weights_equal_peft_merge_and_serve_a_plain_model():
    trainer = trained()
    merged = trainer.policy_state_dict()
    plain = tiny_llama()
    assert set(merged) == set(plain.state_dict())  # the base model's own names: the engine needs nothing else
    reference = copy.deepcopy(trainer.lora).merge_and_unload().state_dict()
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(merged[k], v) for k, v in plain.state_dict().items())  # the adapters moved it
    plain.load_state_dict(merged)
    ids = [3, 17, 40, 9, 77]
    torch.testing.assert_close(logits(plain, ids), logits(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_holds_the_merged_model_and_a_peft_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = trained()
    trainer.save_model(tmp_path / "model")
    ids = [5, 6, 7, 8]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(logits(merged, ids), logits(trainer.model, ids), rtol=1e-5, atol=1e-5)
    adapted = PeftModel.from_pretrained(tiny_llama(), tmp_path / "model" / "adapter")
    torch.testing.assert_close(logits(adapted, ids), logits(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_resume_rebuilds_the_adapter_exactly_over_the_same_base():
    a = trained(steps=1)
    state = copy.deepcopy(a.state_dict())
    b = TorchTrainer(tiny_llama(), cfg())
    b.load_state_dict(state)
    batch = make_batch(rollout_batch(tiny_llama(), n=8, seed=2))
    a.train_step(batch)
    b.train_step(batch)
    for key, value in a.policy_state_dict().items():
        assert torch.equal(b.policy_state_dict()[key], value), key


def test_resume_refuses_another_base_rank_or_no_lora():
    state = trained(steps=1).state_dict()
    with pytest.raises(CheckpointError, match="base weights differ"):
        TorchTrainer(tiny_llama(seed=1), cfg()).load_state_dict(copy.deepcopy(state))
    with pytest.raises(CheckpointError, match=r"\(4, 32\) in the checkpoint, \(2, 32\) here \(trainer.lora.rank changed"):
        TorchTrainer(tiny_llama(), cfg(rank=2)).load_state_dict(copy.deepcopy(state))
    with pytest.raises(CheckpointError, match="does not fit trainer.lora"):
        TorchTrainer(tiny_llama(), cfg(target_modules=["q_proj"])).load_state_dict(copy.deepcopy(state))
    with pytest.raises(CheckpointError, match="trained with LoRA and trainer.lora.rank is 0"):
        TorchTrainer(tiny_llama(), TrainerConfig(lr=1e-2)).load_state_dict(copy.deepcopy(state))


def test_bad_lora_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="matches no linear layer"):
        TorchTrainer(tiny_llama(), cfg(target_modules=["qkv"]))
    with pytest.raises(ConfigError, match="trainer.lora.rank=4: LoRA runs on trainer.backend=torch only"):
        load_config(None, ["trainer.backend=megatron", "trainer.lora.rank=4"])
    with pytest.raises(ConfigError, match="trainer.lora.rank"):
        load_config(None, ["trainer.lora.rank=-1"])


def test_the_adapter_init_is_seeded_and_leaves_the_global_rng_alone():
    models = [tiny_llama() for _ in range(3)]  # (tiny_llama seeds the global RNG itself)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = TorchTrainer(models[0], cfg()).state_dict()["lora"]["adapter"]
    assert torch.equal(torch.rand(3), expected)
    b = TorchTrainer(models[1], cfg()).state_dict()["lora"]["adapter"]
    c = TorchTrainer(models[2], cfg(init_seed=1)).state_dict()["lora"]["adapter"]
    key = next(k for k in a if "lora_A" in k)
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
