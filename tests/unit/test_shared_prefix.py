"""Shared-prefix training: the plan of micro-batches, and log-probs and gradients equal to the plain forward."""

from __future__ import annotations

import pytest
import torch

from relax_agent.config import TrainerConfig
from relax_agent.errors import DataError
from relax_agent.records import MediaInputs
from relax_agent.train.backends.torch_backend import TorchTrainer, token_logprobs_and_entropy
from relax_agent.train.backends.torch_backend.shared_prefix import (
    can_share,
    plan_micro_batches,
    row_caps,
    shared_prefix_forward,
)
from relax_agent.train.batch import TrainBatch

VOCAB = 128


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def make_batch(groups: list[tuple[int, list[int]]], seed: int = 0, interleave: bool = True) -> TrainBatch:
    """Rows of ``groups`` ([(prompt_len, [response lengths])]), each group one random prompt;
    with ``interleave`` the rows of the groups alternate (the plan must regroup them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, (prompt_len, lengths) in enumerate(groups):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        rows.append([(k, prompt, torch.randint(1, VOCAB, (n,), generator=g)) for n in lengths])
    flat = [r for batch in zip(*rows, strict=False) for r in batch] if interleave else [r for grp in rows for r in grp]
    if interleave:  # zip stops at the shortest group: add the rest
        flat += [r for grp in rows for r in grp if not any(r is f for f in flat)]
    t = max(len(p) + len(c) for _, p, c in flat)
    b = len(flat)
    ids, attn, loss = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.bool)
    for i, (_, p, c) in enumerate(flat):
        n = len(p) + len(c)
        ids[i, :n] = torch.cat([p, c])
        attn[i, :n] = 1
        loss[i, len(p):n] = True
    lp = torch.where(loss, torch.full((b, t), -2.0), torch.zeros(b, t))
    adv = torch.tensor([(-1.0) ** i * (1 + i / 10) for i in range(b)])
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss, rollout_logprobs=lp, advantages=adv)


def rows_of(micro: TrainBatch, batch: TrainBatch) -> list[int]:
    """Indices in ``batch`` of the rows of ``micro`` (rows are distinct in these tests)."""
    out = []
    for row in range(micro.size):
        n = int(micro.attention_mask[row].sum())
        hits = [i for i in range(batch.size) if int(batch.attention_mask[i].sum()) == n
                and torch.equal(batch.input_ids[i, :n], micro.input_ids[row, :n])]
        assert len(hits) == 1
        out.append(hits[0])
    return out


def test_plan_puts_each_group_together_with_its_prompt_as_the_prefix():
    batch = make_batch([(30, [4, 6, 5]), (25, [3, 7, 2])])  # rows alternate g0, g1, g0, ...
    plan = plan_micro_batches(batch, micro_batch_size=8, max_tokens=None)
    assert sorted((mb.prefix_len, sorted(rows_of(mb.batch, batch))) for mb in plan) == [(24, [1, 3, 5]), (29, [0, 2, 4])]
    for mb in plan:  # trimmed to the longest row of the micro-batch
        assert mb.batch.input_ids.shape[1] == int(mb.batch.attention_mask.sum(dim=1).max())


def test_plan_counts_the_prefix_once_against_the_token_cap_and_keeps_every_row_once():
    batch = make_batch([(40, [5, 6, 7, 8, 9]), (10, [3]), (44, [4, 4])], interleave=False)
    plan = plan_micro_batches(batch, micro_batch_size=3, max_tokens=40 + 2 * 9)
    seen = sorted(r for mb in plan for r in rows_of(mb.batch, batch))
    assert seen == list(range(batch.size))
    for mb in plan:
        assert mb.batch.size <= 3
        if mb.prefix_len:
            longest_suffix = int(mb.batch.attention_mask.sum(dim=1).max()) - mb.prefix_len
            assert mb.prefix_len + mb.batch.size * longest_suffix <= 58
    shared = sorted((mb.prefix_len, mb.batch.size) for mb in plan if mb.prefix_len)
    # group 0 (suffixes of 6..10 tokens after its 39-token prefix) splits by the cap; group 2 shares 43
    assert shared == [(39, 2), (39, 2), (43, 2)]
    alone = [mb for mb in plan if not mb.prefix_len]  # the fifth row of group 0, and the single row of group 1
    assert sorted(mb.batch.size for mb in alone) == [1, 1]


def test_rows_that_share_too_little_take_the_plain_forward():
    batch = make_batch([(3, [4]), (3, [5]), (3, [2]), (12, [4, 4])])  # the last two share 11 tokens: not worth it
    assert all(mb.prefix_len == 0 for mb in plan_micro_batches(batch, 8, None))
    assert sum(mb.batch.size for mb in plan_micro_batches(batch, 8, None)) == 5


def test_the_prefix_stops_before_the_first_scored_token():
    batch = make_batch([(20, [4, 4])])
    loss = batch.loss_mask.clone()
    loss[1, 10] = True  # an earlier policy turn inside the shared prompt
    early = TrainBatch(batch.input_ids, batch.attention_mask, loss, batch.rollout_logprobs, batch.advantages)
    assert row_caps(batch) == [19, 19]
    assert row_caps(early) == [19, 9]
    plan = plan_micro_batches(early, 8, None)
    assert [(mb.prefix_len, mb.batch.size) for mb in plan] == [(0, 2)]  # 9 tokens: not worth a group


def test_shared_forward_gives_the_plain_log_probs_and_gradient():
    model = tiny_llama()
    batch = make_batch([(40, [6, 9, 3])])

    def run(prefix_len: int):
        model.zero_grad()
        lp, ent = token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, 0.7,
                                             first_position=40, prefix_len=prefix_len)
        (lp * torch.linspace(-1, 2, lp.shape[1])).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in model.parameters()]

    plain, shared = run(0), run(39)
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(shared[1], plain[1], rtol=0, atol=1e-12)
    # Llama's RMSNorm runs in fp32 inside this fp64 model, so the summed-then-rounded gradient of the
    # shared prefix differs from the rounded-then-summed one at fp32 precision.
    scale = max(float(g.abs().max()) for g in plain[2])
    for a, b in zip(shared[2], plain[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * scale)
    assert scale > 0


def test_shared_forward_runs_the_prefix_through_the_model_once():
    model = tiny_llama()
    batch = make_batch([(40, [6, 9, 3])])
    seen: list[int] = []
    handle = model.model.embed_tokens.register_forward_hook(lambda _m, inp, _out: seen.append(int(inp[0].numel())))
    try:
        shared_prefix_forward(model, batch.input_ids, batch.attention_mask, prefix_len=39, logits_from=39)
    finally:
        handle.remove()
    t = batch.input_ids.shape[1]
    assert seen == [39, 3 * (t - 39)]


def test_shared_forward_refuses_rows_that_differ_in_the_prefix():
    batch = make_batch([(20, [3]), (20, [4])])
    with pytest.raises(DataError, match="do not share their first 19 tokens"):
        shared_prefix_forward(tiny_llama(), batch.input_ids, batch.attention_mask, prefix_len=19, logits_from=19)
    with pytest.raises(DataError, match="prefix_len <= logits_from"):
        shared_prefix_forward(tiny_llama(), batch.input_ids, batch.attention_mask, prefix_len=19, logits_from=5)


@pytest.mark.parametrize("cfg", [{}, {"loss": "gspo", "loss_agg": "seq_mean"}, {"mismatch": {"mode": "icepop"}}],
                         ids=["ppo_clip", "gspo", "icepop"])
def test_trainer_step_is_the_same_with_and_without_sharing(cfg):
    batch = make_batch([(30, [4, 6, 5, 2]), (25, [3, 7, 2]), (12, [5])])
    out = {}
    for shared in (False, True):
        model = tiny_llama()
        trainer = TorchTrainer(model, TrainerConfig(lr=1e-3, micro_batch_size=2, micro_batch_tokens=64,
                                                    shared_prefix=shared, **cfg))
        # the comparison means something only if the shared run shares: three pairs of rows under a prefix
        assert sorted(mb.prefix_len for mb in trainer._micro_batches(batch) if mb.prefix_len) == ([] if not shared
                                                                                                 else [24, 29, 29])
        metrics = trainer.train_step(batch)
        out[shared] = (metrics, {k: v.detach().clone() for k, v in model.state_dict().items()})
    plain, shared = out[False], out[True]
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/ratio_mean", "train/tokens",
                "train/policy_tokens", "train/sequences"):
        assert shared[0][key] == pytest.approx(plain[0][key], rel=1e-9, abs=1e-12), key
    assert shared[0]["train/grad_norm"] == pytest.approx(plain[0]["train/grad_norm"], rel=1e-6)
    for name, weight in plain[1].items():
        torch.testing.assert_close(shared[1][name], weight, rtol=0, atol=1e-8, msg=name)


def test_only_text_batches_on_a_cached_model_share():
    model = tiny_llama()
    batch = make_batch([(20, [3, 4])])
    assert can_share(model, batch)
    media = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs,
                       batch.advantages, media=(None, MediaInputs(kinds=(), num_tokens=(), arrays={})))
    assert not can_share(model, media)
    routes = torch.zeros(*batch.input_ids.shape, 1, 1, dtype=torch.uint8)
    replayed = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs,
                          batch.advantages, routed_experts=routes, routes_mask=batch.loss_mask.clone())
    assert not can_share(model, replayed)
    model.gradient_checkpointing_enable() if not hasattr(model, "activation_checkpointing_enable") \
        else model.activation_checkpointing_enable()
    assert not can_share(model, batch)


def test_select_keeps_the_order_asked_trims_and_carries_routes_and_media():
    batch = make_batch([(5, [2, 9]), (4, [1])], interleave=False)  # row lengths 7, 14, 5
    routes = torch.arange(batch.input_ids.numel(), dtype=torch.int16).view(*batch.input_ids.shape, 1, 1)
    media = (None, MediaInputs(kinds=(), num_tokens=(), arrays={}), None)
    full = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs,
                      batch.advantages, routed_experts=routes, routes_mask=batch.loss_mask.clone(), media=media)
    picked = full.select([2, 0])
    assert picked.input_ids.shape == (2, 7)  # trimmed to row 0's 7 tokens
    assert torch.equal(picked.input_ids, batch.input_ids[[2, 0], :7])
    assert torch.equal(picked.advantages, batch.advantages[[2, 0]])
    assert torch.equal(picked.routed_experts, routes[[2, 0], :7])
    assert picked.media == (None, None)
    sliced = full.select(slice(1, 3))
    assert sliced.input_ids.shape == (2, 14) and sliced.media == media[1:]
    assert [mb.advantages.tolist() for mb in full.split(2)] == [m.advantages.tolist() for m in
                                                                (full.select(slice(0, 2)), full.select([2]))]
    with pytest.raises(DataError, match="at least one row"):
        full.select([])
