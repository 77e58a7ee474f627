"""trainer.backend=megatron on CPU (gloo): HF logits, the torch backend's loss and gradients at TP=1 and
TP=2, weight sync from sharded ranks, R3 through Megatron's router replay, and resume state."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relax_agent.config import EngineConfig, ModelConfig
from relax_agent.errors import CheckpointError, DataError
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.moe import ROUTE_FLIP_FRAC
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MAX
from relax_agent.train.backends.base import Trainer
from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import TrainBatch, collate
from relax_agent.train.config import TrainerConfig
from relax_agent.weights import WeightSyncConfig, build_weight_sync

pytestmark = pytest.mark.slow


def cfg(tp: int = 1, sp: bool = False, **kw) -> TrainerConfig:
    return TrainerConfig(backend="megatron", megatron={"tensor_parallel": tp, "sequence_parallel": sp},
                         micro_batch_size=2, lr=1e-4, **kw)


def text_batch(seed: int = 0, b: int = 3, t: int = 12) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 5000, (b, t), generator=g)
    am = torch.ones_like(ids)
    am[1, t - 4:] = 0
    lm = am.bool() & (torch.arange(t) >= 4)
    old = -torch.rand(b, t, generator=g) * 6 * lm
    return TrainBatch(ids, am, lm, old, torch.tensor([1.0, -0.7, 0.4][:b]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_policy(ModelConfig(path=str(tiny_model_dir)))[0]


@pytest.fixture(scope="module")
def tp1(llama):
    with cfg(1).build(model=llama) as trainer:
        yield trainer


@pytest.fixture(scope="module")
def tp2(llama):
    with cfg(2).build(model=llama) as trainer:
        yield trainer


def torch_gradients(model, batch, **kw):
    trainer = TorchTrainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=2, lr=1e-4, **kw))
    metrics = trainer.compute_gradients(batch)
    return metrics, {k: p.grad for k, p in trainer.model.named_parameters() if p.grad is not None}


def test_the_proxy_is_a_trainer(tp1):
    assert isinstance(tp1, Trainer)


@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_same_loss_and_gradients_as_the_torch_backend(which, request, llama):
    trainer = request.getfixturevalue(which)
    batch = text_batch()
    want_metrics, want = torch_gradients(llama, batch)
    got = trainer.gradients(batch)
    assert abs(got["metrics"]["train/loss"] - want_metrics["train/loss"]) <= 1e-5
    assert abs(got["metrics"][MISMATCH_ABS_DIFF_MAX] - want_metrics[MISMATCH_ABS_DIFF_MAX]) <= 1e-4
    for name, grad in want.items():
        assert rel(got["grads"][name], grad) <= 1e-4, name


@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_logits_and_export_match_the_hf_policy(which, request, llama):
    trainer = request.getfixturevalue(which)
    batch = text_batch(1)
    with torch.no_grad():
        want = llama(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    got = trainer.logits(batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    assert (got - want)[real].abs().max() <= 1e-5
    exported, state = trainer.policy_state_dict(), llama.state_dict()
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], v) for k, v in state.items())


FAMILY_CONFIGS = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_gives_the_hf_logits_and_exports_exactly(family):
    kw = dict(FAMILY_CONFIGS[family])
    config = AutoConfig.for_model(kw.pop("model_type"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=5000,
                                  max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases / norms too, so a dropped tensor would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = text_batch(2)
    with torch.no_grad():
        want = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    with cfg(1).build(model=model) as trainer:
        got = trainer.logits(batch.input_ids, batch.attention_mask)
        exported = trainer.policy_state_dict()
    assert (got - want)[batch.attention_mask.bool()].abs().max() <= 1e-5
    state = model.state_dict()
    assert exported.keys() == state.keys() and all(torch.equal(exported[k], v) for k, v in state.items())


def test_weight_sync_publishes_what_the_torch_backend_would(tiny_model_dir, llama, tp2):
    batch = text_batch(3)
    torch_trainer = TorchTrainer(copy.deepcopy(llama), TrainerConfig(micro_batch_size=2, lr=1e-4))
    torch_trainer.train_step(batch)
    with cfg(2).build(model=llama) as megatron:
        m = megatron.train_step(batch)
        assert m["train/step"] == 1.0
        model, tok = load_policy(ModelConfig(path=str(tiny_model_dir)))
        engine = HFEngine(model, tok, EngineConfig(), seed=0)
        sync = build_weight_sync(WeightSyncConfig(transport="inproc"), [engine])
        try:
            stats = sync.publish(megatron.policy_state_dict(), 1)
            got, want = engine._model.state_dict(), torch_trainer.model.state_dict()
            assert engine.policy_version == 1 and got.keys() == want.keys()
            # weights.verify (on by default): the engine's digest of the gathered shards matched
            assert stats.verify_s > 0 and engine.stats.weight_verify_s > 0
            before = llama.state_dict()
            for name, value in want.items():
                assert not torch.equal(value, before[name]) or name.endswith("norm.weight"), name
                # one AdamW step of lr 1e-4: the two backends' gradients agree to ~1e-6 relative
                assert (got[name] - value).abs().max() <= 1e-6, name
        finally:
            sync.close()
            engine.close()


def test_state_round_trip_and_layout_check(llama, tmp_path):
    batch = text_batch(4)
    with cfg(2).build(model=llama) as a:
        a.train_step(batch)
        a.save_model(tmp_path / "model")
        state = a.state_dict()
        a.train_step(batch)
        want = a.policy_state_dict()
    resumed_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with cfg(2).build(model=resumed_model) as b:
        b.load_state_dict(state)
        assert b.step == 1
        metrics = b.train_step(batch)
        assert metrics["train/step"] == 2.0
        got = b.policy_state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        with pytest.raises(CheckpointError, match="tensor_parallel"):
            b.load_state_dict({**state, "layout": {"tensor_parallel": 1, "expert_parallel": 1}})
        with pytest.raises(CheckpointError, match="not a megatron trainer"):
            b.load_state_dict({"optimizer": {}, "step": 1})


def test_a_batch_without_policy_tokens_is_a_data_error_and_the_ranks_stay_up(tp1):
    batch = text_batch(5)
    empty = TrainBatch(batch.input_ids, batch.attention_mask, torch.zeros_like(batch.loss_mask),
                       batch.rollout_logprobs, batch.advantages)
    with pytest.raises(DataError, match="no policy tokens"):
        tp1.train_step(empty)
    assert tp1.logits(batch.input_ids, batch.attention_mask).shape[:2] == batch.input_ids.shape


# -- R3 on Megatron ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", seed=0)
    return load_policy(ModelConfig(path=str(path)))


@pytest.fixture(scope="module")
def moe_batch(moe):
    """Engine rollouts (fp32, routes recorded) of three prompts, collated with their routes."""
    from relax_agent.records import Trajectory, Turn

    model, tok = moe
    prompts = [[1, 504, 2116, 30, 1536], [1, 42, 43], [1, 900, 901, 902, 903, 904, 905]]
    with HFEngine(copy.deepcopy(model), tok, EngineConfig(max_batch_size=8), record_routes=True) as engine:
        gens = engine.generate_many(prompts, [SamplingParams(max_new_tokens=8, seed=s) for s in range(3)])
    trajs = []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        turn = Turn(len(p), g.token_ids, g.logprobs, g.policy_version, g.finish_reason, g.routed_experts)
        ids = tuple(p) + tuple(g.token_ids)
        trajs.append(Trajectory(f"s{i}", "g", "t", ids, (0,) * len(p) + (1,) * len(g.token_ids),
                                (0.0,) * len(p) + tuple(g.logprobs), len(p), (turn,), 1.0))
    return collate(trajs, [1.0, -0.5, 0.5], pad_token_id=0)


def forced_routes(batch: TrainBatch) -> TrainBatch:
    forced = batch.routed_experts.clone()
    forced[batch.routes_mask] = (forced[batch.routes_mask] + 3) % 8  # experts the router would not pick
    return TrainBatch(**{**batch.__dict__, "routed_experts": forced})


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["tp1", "tp2_sp"])
def moe_trainer(request, moe):
    tp, sp = request.param
    with cfg(tp, sp).build(model=moe[0], routing_replay=True) as trainer:
        yield trainer


def test_fp32_replay_reproduces_the_engine_logprobs(moe_trainer, moe_batch):
    metrics = moe_trainer.gradients(moe_batch)["metrics"]
    assert metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5
    assert metrics[ROUTE_FLIP_FRAC] == 0.0
    assert metrics["moe/replayed_tokens"] == moe_batch.num_policy_tokens


def test_replayed_routes_are_followed_exactly_and_routers_learn(moe_trainer, moe, moe_batch):
    """Forced routes no router would pick: Megatron gives the torch backend's replayed loss and
    gradients (whose experts tests/unit/test_moe_replay.py checks one by one)."""
    batch = forced_routes(moe_batch)
    torch_trainer = TorchTrainer(copy.deepcopy(moe[0]), TrainerConfig(micro_batch_size=2, lr=1e-4), routing_replay=True)
    want_metrics = torch_trainer.compute_gradients(batch)
    want = {k: p.grad for k, p in torch_trainer.model.named_parameters() if p.grad is not None}
    got = moe_trainer.gradients(batch)
    assert got["metrics"][ROUTE_FLIP_FRAC] == 1.0
    assert got["metrics"][MISMATCH_ABS_DIFF_MAX] > 1e-3  # other experts really ran
    assert abs(got["metrics"][MISMATCH_ABS_DIFF_MAX] - want_metrics[MISMATCH_ABS_DIFF_MAX]) <= 1e-5
    assert abs(got["metrics"]["train/loss"] - want_metrics["train/loss"]) <= 1e-5
    for name, grad in want.items():
        assert rel(got["grads"][name], grad) <= 1e-4, name
    for layer in range(2):
        router = got["grads"][f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.isfinite(router).all() and router.abs().sum() > 0


def test_moe_trains_under_megatron_with_routing_replay(moe_trainer, moe_batch):
    first = moe_trainer.train_step(moe_batch)
    second = moe_trainer.train_step(moe_batch)
    assert second["train/step"] == first["train/step"] + 1
    assert first["moe/replayed_tokens"] == moe_batch.num_policy_tokens
    assert second["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(second["train/loss"]))


def test_replay_without_routes_is_a_data_error(moe_trainer, moe_batch):
    plain = TrainBatch(moe_batch.input_ids, moe_batch.attention_mask, moe_batch.loss_mask,
                       moe_batch.rollout_logprobs, moe_batch.advantages)
    with pytest.raises(DataError, match="no routed_experts"):
        moe_trainer.train_step(plain)


# -- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_one_gpu_with_nccl(llama):
    batch = text_batch()
    with cfg(1, dtype="bf16").build(model=llama, device="cuda") as trainer:
        metrics = trainer.train_step(batch)
    assert metrics["train/step"] == 1.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_the_sft_warm_up_step_is_the_torch_backends_on_the_shards(llama):
    """The warm-up's NLL, gradient norm and clipped AdamW step at TP=2 give the torch backend's loss,
    norm and weights; the RL step after it has the torch backend's gradient norm too (the norm counts
    every rank's shards: Megatron tags sharded weights only when it initialises them)."""
    batch = text_batch(4)
    torch_trainer = TorchTrainer(copy.deepcopy(llama), TrainerConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0))
    want = torch_trainer.sft_step(batch, lr=1e-4)
    after_sft = {k: v.clone() for k, v in torch_trainer.model.state_dict().items()}
    with cfg(2, grad_clip=1.0).build(model=llama) as megatron:
        got = megatron.sft_step(batch, lr=1e-4)
        megatron.end_sft()
        exported = megatron.policy_state_dict()
        rl = megatron.train_step(batch)
    want_rl = torch_trainer.train_step(batch)
    assert want["sft/grad_norm"] > 1.0  # the clip is active
    assert abs(got["sft/loss"] - want["sft/loss"]) <= 1e-5 and got["sft/tokens"] == want["sft/tokens"]
    assert got["sft/grad_norm"] == pytest.approx(want["sft/grad_norm"], rel=1e-4)
    for name, value in after_sft.items():
        assert (exported[name] - value).abs().max() <= 1e-6, name
    assert rl["train/grad_norm"] == pytest.approx(want_rl["train/grad_norm"], rel=1e-4)


@pytest.mark.parametrize("algo", [dict(loss="gspo", loss_agg="seq_mean", clip_eps_low=0.05, clip_eps_high=0.08,
                                       mismatch={"mode": "icepop", "low": 0.6, "high": 1.6}),
                                  dict(loss="cispo", mismatch={"mode": "seq_tis", "high": 1.5})])
def test_other_objectives_and_mismatch_corrections_match_the_torch_backend(algo, llama):
    """The loss path is shared: GSPO / CISPO under a mismatch correction give the torch backend's numbers."""
    from relax_agent.train.backends.torch_backend import token_logprobs

    base = text_batch(2)
    with torch.no_grad():  # rollout log-probs near the policy's: some tokens in the band, some out
        lp = token_logprobs(llama, base.input_ids, base.attention_mask)
    noise = 0.6 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(base.input_ids, base.attention_mask, base.loss_mask, (lp + noise) * base.loss_mask,
                       base.advantages)
    want_metrics, want = torch_gradients(llama, batch, **algo)
    with cfg(2, **algo).build(model=llama) as trainer:
        got = trainer.gradients(batch)
    for key in ("train/loss", "mismatch/masked_token_frac", "mismatch/clipped_token_frac"):
        assert abs(got["metrics"][key] - want_metrics[key]) <= 1e-5 * max(1.0, abs(want_metrics[key])), key
    assert 0 < want_metrics["mismatch/masked_token_frac"] + want_metrics["mismatch/clipped_token_frac"] < 1
    assert sum(float(g.norm()) for g in want.values()) > 1e-3
    for name, grad in want.items():
        assert rel(got["grads"][name], grad) <= 1e-4, name
