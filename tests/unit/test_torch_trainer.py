"""Collation, token log-probs and the torch trainer, checked against plain torch and the reference."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from relax_agent.config import TrainerConfig
from relax_agent.errors import CheckpointError, ConfigError, DataError
from relax_agent.records import Trajectory, Turn
from relax_agent.train import reference_grpo as ref
from relax_agent.train.algorithms import CLIP_FRAC, MISMATCH_ABS_DIFF_MAX, RATIO_MEAN
from relax_agent.train.backends import torch_backend as tb
from relax_agent.train.backends.torch_backend import TorchTrainer, token_logprobs, token_logprobs_and_entropy
from relax_agent.train.backends.torch_backend.logprobs import _TokenLogprob
from relax_agent.train.batch import TrainBatch, collate, trajectory_advantages

VOCAB = 128
PAD = 0


def tiny_llama(seed: int = 0):
    """A 2-layer random Llama (vocab 128, hidden 32) built from a config: no hub needed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama()


def make_traj(i: int, group: str, prompt: list[int], completion: list[int], logprobs: list[float],
              reward: float, status: str = "ok") -> Trajectory:
    n_p = len(prompt)
    turn = Turn(n_p, tuple(completion), tuple(logprobs), 0, "stop")
    return Trajectory(
        sample_id=f"{group}/{i}", group_id=group, task_id=group, token_ids=tuple(prompt + completion),
        loss_mask=tuple([0] * n_p + [1] * len(completion)),
        rollout_logprobs=tuple([0.0] * n_p + list(logprobs)), prompt_len=n_p, turns=(turn,),
        reward=reward, reward_status=status,
    )


def naive_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return ref.sequence_logprobs(model, ids, temperature)


def rollout_batch(model, n: int = 8, seed: int = 0, noise: float = 0.0, temperature: float = 1.0,
                  invalid: tuple[int, ...] = ()) -> list[Trajectory]:
    """Random sequences of uneven length in groups of 4, with the model's own log-probs (+ noise)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        completion = torch.randint(1, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        lp = naive_logprobs(model, prompt + completion, temperature)[len(prompt):]
        lp = (lp + noise * torch.randn(lp.shape, generator=g)).float()  # engines report fp32
        reward = float(torch.randint(0, 3, (1,), generator=g))
        status = "error" if i in invalid else "ok"
        trajs.append(make_traj(i, f"g{i // 4}", prompt, completion, lp.tolist(), reward, status))
    return trajs


def to_reference(trajs: list[Trajectory]) -> list[ref.Sample]:
    groups = {g: k for k, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    return [ref.Sample(list(t.token_ids), list(t.loss_mask), list(t.rollout_logprobs), t.reward,
                       groups[t.group_id], t.trainable) for t in trajs]


def make_batch(trajs: list[Trajectory], std_normalize: bool = True) -> TrainBatch:
    return collate(trajs, trajectory_advantages(trajs, std_normalize), PAD)


def cfg(**kw) -> TrainerConfig:
    base = dict(lr=1e-3, micro_batch_size=8, grad_clip=1.0, clip_eps_low=0.2, clip_eps_high=0.28)
    return TrainerConfig(**{**base, **kw})


# -- collation --------------------------------------------------------------------------------


def test_collate_right_pads_and_masks_failed_samples():
    a = make_traj(0, "g", [5, 6], [7, 8, 9], [-0.5, -1.0, -1.5], 1.0)
    b = make_traj(1, "g", [5], [4], [-2.0], 0.0)
    c = make_traj(2, "g", [5, 6, 7], [1], [-0.1], 0.0, status="timeout")
    batch = collate([a, b, c], [1.0, -1.0, 0.0], pad_token_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0], [5, 6, 7, 1, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert batch.loss_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False],
                                        [False] * 5]
    assert batch.rollout_logprobs[0].tolist() == [0.0, 0.0, -0.5, -1.0, -1.5]
    assert batch.rollout_logprobs[1, 1].item() == -2.0
    assert batch.advantages.tolist() == [1.0, -1.0, 0.0]
    assert (batch.num_tokens, batch.num_policy_tokens, batch.size) == (11, 4, 3)


def test_split_trims_each_micro_batch_to_its_own_length():
    long = make_traj(0, "g", [5, 6], [7, 8, 9, 10], [-1.0] * 4, 1.0)
    short = make_traj(1, "g", [5], [4], [-2.0], 0.0)
    batch = collate([short, short, long], [0.5, 0.5, -1.0], PAD)
    micro = batch.split(2)
    assert [m.input_ids.shape for m in micro] == [torch.Size([2, 2]), torch.Size([1, 6])]
    assert micro[1].advantages.tolist() == [-1.0]
    assert micro[0].loss_mask.tolist() == [[False, True], [False, True]]
    with pytest.raises(DataError, match="micro_batch_size must be >= 1; got 0"):
        batch.split(0)


def test_a_token_cap_splits_where_rows_times_the_longest_would_exceed_it():
    rows = [make_traj(i, "g", [5] * n, [7], [-1.0], 1.0) for i, n in enumerate([1, 1, 1, 5, 1, 9, 2])]
    batch = collate(rows, [1.0] * 7, PAD)  # lengths 2 2 2 6 2 10 3
    micro = batch.split(8, max_tokens=8)
    assert [m.input_ids.shape for m in micro] == [torch.Size([3, 2]), torch.Size([1, 6]), torch.Size([1, 2]),
                                                  torch.Size([1, 10]), torch.Size([1, 3])]  # 10 > 8 alone
    assert [m.size for m in batch.split(2, max_tokens=100)] == [2, 2, 2, 1]  # the row cap still holds
    assert [m.size for m in batch.split(8)] == [7]
    with pytest.raises(DataError, match="micro_batch_tokens must be >= 1 .*got 0"):
        batch.split(8, max_tokens=0)


def test_collate_rejects_bad_input():
    a = make_traj(0, "g", [5], [7], [-0.5], 1.0)
    with pytest.raises(DataError, match="2 advantages for 1 rows"):
        collate([a], [1.0, 2.0], PAD)
    with pytest.raises(DataError, match="at least one"):
        collate([], [], PAD)
    bad = make_traj(1, "g", [], [7, 8], [-0.5, -0.5], 1.0)
    with pytest.raises(DataError, match="token 0"):
        collate([bad], [1.0], PAD)


def test_trajectory_advantages_group_by_id_and_skip_failures():
    trajs = [make_traj(0, "a", [1], [2], [-1.0], 1.0), make_traj(1, "b", [1], [2], [-1.0], 5.0),
             make_traj(2, "a", [1], [2], [-1.0], 0.0), make_traj(3, "a", [1], [2], [-1.0], 9.0, "error")]
    adv = trajectory_advantages(trajs, std_normalize=False)
    assert adv.tolist() == [0.5, 0.0, -0.5, 0.0]


def test_trajectory_advantages_skip_samples_without_policy_tokens():
    """A prompt that alone fills max_total_tokens gives an episode with no turns: no advantage, no group share."""
    no_turn = Trajectory(sample_id="a/3", group_id="a", task_id="a", token_ids=(1, 1), loss_mask=(0, 0),
                         rollout_logprobs=(0.0, 0.0), prompt_len=2, turns=(), reward=0.0, stop_reason="max_total_tokens")
    trajs = [make_traj(0, "a", [1], [2], [-1.0], 1.0), make_traj(1, "a", [1], [2], [-1.0], 3.0), no_turn]
    assert trajectory_advantages(trajs, std_normalize=False).tolist() == [-1.0, 1.0, 0.0]


# -- token log-probs --------------------------------------------------------------------------


def test_token_logprobs_equal_plain_log_softmax_gather(base_model):
    seqs = [[3, 17, 99, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
    batch = collate([make_traj(i, "g", s[:1], s[1:], [0.0] * (len(s) - 1), 0.0) for i, s in enumerate(seqs)],
                    [0.0] * 3, PAD)
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(base_model, batch.input_ids, batch.attention_mask, 0.7, chunk_tokens=4)
        logits = base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / 0.7
    log_sm = torch.log_softmax(logits, dim=-1)
    expected = torch.zeros(3, 7)
    expected[:, 1:] = log_sm[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    expected_ent = torch.zeros(3, 7)
    expected_ent[:, 1:] = -(log_sm.exp() * log_sm).sum(-1)[:, :-1]
    real = batch.attention_mask.bool()
    expected, expected_ent = expected * real, expected_ent * real
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, expected_ent, rtol=0, atol=1e-5)
    assert lp[:, 0].abs().sum() == 0 and lp[1, 3:].abs().sum() == 0  # position 0 and padding hold 0
    # one unpadded sequence at a time (the reference) gives the same numbers
    torch.testing.assert_close(lp[0], naive_logprobs(base_model, seqs[0], 0.7), rtol=0, atol=1e-5)


@pytest.mark.parametrize("first", [1, 3, 4, 6, 99])
def test_logits_from_the_first_scored_position_on_give_the_same_logprobs_and_gradient(base_model, first):
    seqs = [[3, 17, 99, 4, 5, 6, 7], [8, 9, 10, 21, 22], [11, 12, 13, 14, 15, 16]]
    batch = collate([make_traj(i, "g", s[:4], s[4:], [0.0] * (len(s) - 4), 0.0) for i, s in enumerate(seqs)],
                    [0.0] * 3, PAD)
    assert tb.first_scored_position(batch.loss_mask) == 4 and tb.first_scored_position(batch.loss_mask * 0) == 1
    mask = batch.loss_mask.float()

    def run(first_position):
        base_model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs_and_entropy(base_model, batch.input_ids, batch.attention_mask, 0.7,
                                             first_position=first_position)
        if lp.requires_grad:
            (lp * mask).sum().backward()
        return lp.detach(), ent, {n: p.grad for n, p in base_model.named_parameters()}

    shapes = []
    hook = base_model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    try:
        full_lp, full_ent, full_grad = run(1)
        lp, ent, grad = run(first)
    finally:
        hook.remove()
        base_model.zero_grad(set_to_none=True)
    start = min(first, 7) - 1
    assert shapes == [(3, 7, VOCAB), (3, 7 - start, VOCAB)]  # the vocabulary projection of the kept positions only
    keep = torch.arange(7) >= first
    torch.testing.assert_close(lp[:, keep], full_lp[:, keep], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[:, keep], full_ent[:, keep], rtol=0, atol=1e-6)
    assert lp[:, ~keep].abs().sum() == 0 and ent[:, ~keep].abs().sum() == 0
    if first <= 4:  # every position under the loss mask kept: the same loss gradient
        for n, g in full_grad.items():
            torch.testing.assert_close(grad[n], g, rtol=1e-5, atol=1e-7)


def test_token_logprob_gradient_is_exact():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 5, (7,), generator=g)

    def f(x):
        return _TokenLogprob.apply(x, targets, 0.6, 3, False)[0]

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-5)
    upstream = torch.randn(7, dtype=torch.float64, generator=g)
    (f(logits) * upstream).sum().backward()
    plain = logits.detach().clone().requires_grad_(True)
    (torch.log_softmax(plain / 0.6, -1).gather(-1, targets[:, None]).squeeze(-1) * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, plain.grad)


def test_token_logprobs_reject_bad_temperature(base_model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ConfigError, match="temperature must be > 0; got 0"):
        token_logprobs(base_model, ids, ids, temperature=0)


# -- the trainer ------------------------------------------------------------------------------


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batches_give_the_full_batch_gradient(base_model, agg):
    batch = make_batch(rollout_batch(base_model, n=8, noise=0.3, invalid=(2,)))
    full = TorchTrainer(copy.deepcopy(base_model), cfg(micro_batch_size=8, loss_agg=agg))
    m_full, g_full = full.compute_gradients(batch), grads(full.model)
    assert len(g_full) > 0
    longest = int(batch.attention_mask.sum(dim=1).max())
    for split in ({"micro_batch_size": 3}, {"micro_batch_tokens": 2 * longest}):  # by rows, by a token cap
        micro = TorchTrainer(copy.deepcopy(base_model), cfg(**split, loss_agg=agg))
        assert len(batch.split(micro.cfg.micro_batch_size, micro.cfg.micro_batch_tokens)) > 2
        m_micro, g_micro = micro.compute_gradients(batch), grads(micro.model)
        assert g_full.keys() == g_micro.keys()
        for name in g_full:
            torch.testing.assert_close(g_micro[name], g_full[name], rtol=0, atol=1e-5, msg=name)
        for key in (tb.LOSS, CLIP_FRAC, RATIO_MEAN, tb.ENTROPY, MISMATCH_ABS_DIFF_MAX):
            assert m_micro[key] == pytest.approx(m_full[key], abs=1e-5), key


@pytest.mark.parametrize("agg,kl_coef", [("token_mean", 0.0), ("seq_mean", 0.0), ("token_mean", 0.5)])
def test_engine_matches_reference_after_one_step(base_model, agg, kl_coef):
    # float64 end to end: AdamW's first step is lr * g / (|g| + 1e-8), so fp32 rounding on
    # near-zero gradient entries would flip update signs and hide real differences.
    temperature = 0.8
    base_model = copy.deepcopy(base_model).double()
    trajs = rollout_batch(base_model, n=8, seed=4, noise=0.4, temperature=temperature, invalid=(5,))
    reference_policy = tiny_llama(seed=1).double() if kl_coef else None
    c = cfg(loss_agg=agg, kl_coef=kl_coef, micro_batch_size=3, grad_clip=0.5, weight_decay=0.01)

    ours = TorchTrainer(copy.deepcopy(base_model), c, ref_model=copy.deepcopy(reference_policy),
                        temperature=temperature)
    batch = make_batch(trajs)
    ours.compute_gradients(batch)
    our_grads = grads(ours.model)
    metrics = ours.train_step(batch)

    theirs = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(theirs.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
    samples = to_reference(trajs)
    kwargs = dict(clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, agg=agg, temperature=temperature,
                  ref_model=reference_policy, kl_coef=kl_coef)
    # the batch carries fp32 advantages; the reference gets the same numbers (its own
    # advantages are checked against group_advantages in test_algorithms.py)
    torch.testing.assert_close(batch.advantages, torch.tensor(ref.compute_advantages(samples), dtype=torch.float32))
    advantages = batch.advantages.double().tolist()
    loss = ref.grpo_loss(theirs, samples, advantages, **kwargs)
    loss.backward()
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(our_grads[name], p.grad, rtol=0, atol=1e-9, msg=name)
    ref_loss = ref.train_step(theirs, opt, samples, grad_clip=c.grad_clip, advantages=advantages, **kwargs)

    assert metrics[tb.LOSS] == pytest.approx(ref_loss, abs=1e-9)
    assert 0 < metrics[CLIP_FRAC] < 1  # the noise makes clipping active on some tokens
    before = dict(base_model.named_parameters())
    for name, p in theirs.named_parameters():
        ours_p = dict(ours.model.named_parameters())[name]
        torch.testing.assert_close(ours_p - before[name], p - before[name], rtol=0, atol=1e-9, msg=name)


def test_positive_advantage_raises_that_sequence_logprob(base_model):
    up = make_traj(0, "g", [5, 6], [7, 8, 9], [0.0] * 3, 1.0)
    down = make_traj(1, "g", [5, 6], [10, 11, 12], [0.0] * 3, 0.0)
    # rollout log-probs from the model itself: on-policy
    trajs = [make_traj(i, "g", [5, 6], list(t.token_ids[2:]),
                       naive_logprobs(base_model, list(t.token_ids))[2:].tolist(), t.reward)
             for i, t in enumerate((up, down))]
    batch = make_batch(trajs)
    assert batch.advantages.tolist()[0] > 0 > batch.advantages.tolist()[1]
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(lr=1e-2))
    metrics = trainer.train_step(batch)
    assert metrics[RATIO_MEAN] == pytest.approx(1.0, abs=1e-5)  # on-policy: ratio 1, no mismatch
    assert metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5 and metrics[CLIP_FRAC] == 0.0
    after = [naive_logprobs(trainer.model, list(t.token_ids))[2:].sum() for t in trajs]
    before = [naive_logprobs(base_model, list(t.token_ids))[2:].sum() for t in trajs]
    assert after[0] > before[0] + 0.05
    assert after[1] < before[1] - 0.05


def _fp16_cpu_supported() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        torch.amp.GradScaler("cpu")
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


@pytest.mark.skipif(not _fp16_cpu_supported(), reason="this torch has no fp16 CPU autocast or CPU GradScaler")
def test_fp16_autocast_with_loss_scaling_trains(base_model):
    batch = make_batch(rollout_batch(base_model, n=8, noise=0.0))  # rollout log-probs from the fp32 model
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(dtype="fp16", micro_batch_size=4))
    first = trainer.train_step(batch)
    assert first[tb.LOSS_SCALE] > 1
    assert all(math.isfinite(v) for k, v in first.items() if k != tb.GRAD_NORM)
    assert 0 < first[MISMATCH_ABS_DIFF_MAX] < 0.05  # fp16 really ran, and stays near fp32
    second = trainer.train_step(batch)  # a first-step overflow would only have shrunk the scale
    assert trainer.step >= 1 and second[tb.SKIPPED_STEP] == 0.0
    assert next(trainer.model.parameters()).dtype == torch.float32  # fp32 master weights
    assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), base_model.parameters(), strict=True))


def test_bf16_autocast_trains_and_stays_close_to_fp32(base_model):
    batch = make_batch(rollout_batch(base_model, n=8))
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(dtype="bf16", micro_batch_size=4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    assert lp.dtype == torch.float32
    diff = (lp - batch.rollout_logprobs)[batch.loss_mask].abs()
    assert 0 < diff.max() < 0.1  # bf16 really ran (not bit-exact), and stays close
    metrics = trainer.train_step(batch)
    assert metrics[tb.SKIPPED_STEP] == 0.0 and trainer.step == 1
    assert metrics[MISMATCH_ABS_DIFF_MAX] == pytest.approx(float(diff.max()), abs=1e-4)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), base_model.parameters(), strict=True))


def test_state_dict_round_trip_continues_identically(base_model):
    batch = make_batch(rollout_batch(base_model, n=4, noise=0.2))
    c = cfg(warmup_steps=3)
    a = TorchTrainer(copy.deepcopy(base_model), c)
    a.train_step(batch)
    saved_model = copy.deepcopy(a.model.state_dict())
    saved = copy.deepcopy(a.state_dict())
    b = TorchTrainer(copy.deepcopy(base_model), c)
    b.model.load_state_dict(saved_model)
    b.load_state_dict(saved)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma[tb.LR] == mb[tb.LR] == pytest.approx(2e-3 / 3) and b.step == 2
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(CheckpointError, match="lacks"):
        b.load_state_dict({"optimizer": {}})


def test_linear_warmup_and_metrics(base_model):
    batch = make_batch(rollout_batch(base_model, n=4, noise=0.2))
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(lr=1e-3, warmup_steps=4))
    lrs = [trainer.train_step(batch)[tb.LR] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    m = trainer.train_step(batch)
    assert m[tb.TOKENS] == batch.num_tokens and m[tb.POLICY_TOKENS] == batch.num_policy_tokens
    assert m[tb.SEQUENCES] == 4 and m[tb.STEP] == 6 and m[tb.GRAD_NORM] > 0 and m[tb.ENTROPY] > 0
    assert 0.05 < m[tb.RESIDENT_GB] < 1000  # this process's resident memory after the step, in GB


def test_freeze_embeddings_keeps_them_fixed(base_model):
    batch = make_batch(rollout_batch(base_model, n=4, noise=0.2))
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(freeze_embeddings=True, lr=1e-2))
    trainer.train_step(batch)
    emb = trainer.model.get_input_embeddings().weight
    assert torch.equal(emb, base_model.get_input_embeddings().weight)
    assert not torch.equal(trainer.model.lm_head.weight, base_model.lm_head.weight)


def test_kl_needs_a_reference_model_and_a_zero_kl_ignores_it(base_model):
    with pytest.raises(ConfigError, match="kl_coef=0.1 needs a reference model"):
        TorchTrainer(copy.deepcopy(base_model), cfg(kl_coef=0.1))
    with pytest.warns(UserWarning, match="ref_model is ignored"):
        t = TorchTrainer(copy.deepcopy(base_model), cfg(), ref_model=copy.deepcopy(base_model))
    assert t.ref_model is None


def test_kl_to_identical_reference_is_zero(base_model):
    batch = make_batch(rollout_batch(base_model, n=4, noise=0.2))
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(kl_coef=0.3), ref_model=copy.deepcopy(base_model))
    m = trainer.train_step(batch)
    assert m[tb.KL_REF] == pytest.approx(0.0, abs=1e-7)
    assert m[tb.LOSS] == pytest.approx(m[tb.PG_LOSS], abs=1e-7)


def test_batch_without_policy_tokens_is_refused(base_model):
    t = make_traj(0, "g", [5], [6], [-1.0], 1.0, status="error")
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg())
    with pytest.raises(DataError, match="no policy tokens"):
        trainer.train_step(collate([t], [0.0], PAD))


def test_policy_state_dict_is_the_live_model(base_model):
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg())
    sd = trainer.policy_state_dict()
    assert sd.keys() == base_model.state_dict().keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step(make_batch(rollout_batch(base_model, n=4, noise=0.2)))
    assert torch.equal(sd["lm_head.weight"], trainer.model.lm_head.weight)
