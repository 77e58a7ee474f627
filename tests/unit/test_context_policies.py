"""Episodes longer than one context (``rollout.context``): where a new context starts, what it holds, that
every sampled token trains once with the episode's advantage, and that each context replays on its own."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from relax_agent import records as R
from relax_agent.control.reporting import write_rollout_dump, write_token_record
from relax_agent.records import StopReason
from relax_agent.replay import load_token_record, replay_records
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.config import ContextConfig
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser
from relax_agent.train.collate import collate_fields, with_segments

TOOLS = [{"type": "function", "function": {"name": "read", "description": "read the next page",
                                            "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{{"name": "read", "arguments": {{"page": {k}}}}}\n</tool_call>'


class PagesEnv:
    """Reads ``pages`` long pages, one per tool call; reward 1.0 once the last page is read."""

    def __init__(self, pages: int = 6, words: int = 40):
        self.pages, self.words, self.read = pages, words, 0

    def reset(self, seed=None, options=None):
        self.read = 0
        return [{"role": "user", "content": "Read every page with the read tool."}], {"tools": TOOLS}

    def step(self, action):
        calls = action.get("tool_calls") or []
        if not calls:
            return [{"role": "user", "content": "Call the read tool."}], 0.0, False, False, {}
        self.read += 1
        page = " ".join(f"w{self.read}_{i}" for i in range(self.words))
        done = self.read >= self.pages
        return ([{"role": "tool", "tool_call_id": calls[0].get("id"), "content": f"page {self.read}: {page}"}],
                1.0 if done else 0.0, done, False, {})

    def close(self):
        pass


class ScriptedEngine:
    """Calls ``read`` with the next page number; answers a summary request with ``summary`` (its tokens)."""

    policy_version = 3

    def __init__(self, tok, summary="I read pages so far; keep reading.", summary_finish="stop"):
        self.tok, self.summary, self.summary_finish = tok, summary, summary_finish
        self.calls, self.replies, self.summary_caps = 0, [], []

    async def generate(self, prompt_ids, params):
        tail = self.tok.decode(prompt_ids[-80:])
        if "Summarise" in tail:
            self.summary_caps.append(params.max_new_tokens)
            ids = self.tok(self.summary, add_special_tokens=False)["input_ids"][:params.max_new_tokens]
            finish = self.summary_finish
        else:
            self.calls += 1
            ids = self.tok(CALL.format(k=self.calls), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            ids, finish = ids[:params.max_new_tokens], "stop" if len(ids) <= params.max_new_tokens else "length"
        lps = tuple(-0.1 - 0.001 * i for i in range(len(ids)))
        self.replies.append(tuple(ids))
        return Generation(tuple(ids), lps, finish, self.policy_version)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _play(tok, context, max_total_tokens=600, max_new_tokens=48, engine=None, env=None, max_turns=12):
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=max_turns, max_total_tokens=max_total_tokens,
                       context=context)
    engine = engine or ScriptedEngine(tok)
    traj = asyncio.run(run_episode(env or PagesEnv(), spec, engine, ChatRenderer(tok, tool_example=False), HermesParser(),
                                   SamplingParams(max_new_tokens)))
    return traj, engine


def _sampled_once(traj, engine):
    """Every reply the engine sampled is trained in exactly one context, as sampled."""
    trained = [tuple(t.token_ids) for seg in traj.segments for t in seg.turns]
    assert sorted(trained) == sorted(engine.replies)
    for seg in traj.segments:
        mask = np.asarray(seg.loss_mask)
        assert mask.sum() == sum(len(t.token_ids) for t in seg.turns)  # kept turns are context, not trained again
        for t in seg.turns:
            assert list(seg.token_ids[t.start:t.start + len(t.token_ids)]) == list(t.token_ids)
            assert mask[t.start:t.start + len(t.token_ids)].all()
            assert seg.rollout_logprobs[t.start:t.start + len(t.token_ids)] == pytest.approx(t.logprobs)


def test_truncate_ends_the_episode_at_a_full_context(tok):
    traj, _ = _play(tok, None)
    assert traj.stop_reason == StopReason.MAX_TOTAL_TOKENS and traj.context_segments == () and traj.reward == 0.0


def test_drop_oldest_plays_to_the_end_in_windows_of_whole_turns(tok):
    traj, engine = _play(tok, ContextConfig(policy="drop_oldest"))
    assert traj.stop_reason == StopReason.TERMINATED and traj.reward == 1.0
    assert len(traj.context_segments) >= 1 and traj.metrics["context/segments"] == len(traj.segments)
    _sampled_once(traj, engine)
    renderer = ChatRenderer(tok, tool_example=False)
    opening = renderer.render_prompt([{"role": "user", "content": "Read every page with the read tool."}], TOOLS)
    for k, seg in enumerate(traj.segments):
        assert len(seg.token_ids) <= 600
        assert seg.token_ids[:len(opening.token_ids)] == opening.token_ids  # each context opens with the task
        if k < len(traj.segments) - 1:
            assert seg.sample_id == f"g/0/ctx{k}" and seg.stop_reason == StopReason.CONTEXT and seg.reward == 1.0
        after = [m for m in seg.messages[len(opening.messages):]]
        # whole turns: the kept history starts at an assistant turn and every tool result follows its call
        assert not after or after[0]["role"] == "assistant"
        for i, m in enumerate(after):
            if m["role"] == "tool":
                assert after[i - 1]["role"] == "assistant" and after[i - 1]["tool_calls"]
    for prev, seg in zip(traj.segments, traj.segments[1:], strict=False):  # kept turns are the old tokens, verbatim
        kept = seg.token_ids[len(opening.token_ids):seg.turns[0].start]
        tails = [prev.token_ids[t.start - t.opening:] for t in prev.turns]  # whole turns to the old context's end
        assert any(kept[:len(tail)] == tail for tail in tails) and len(kept) > max(map(len, [()] + [
            t for t in tails if kept[:len(t)] == t]))  # then the pending observation


def test_compact_asks_the_policy_for_a_summary_and_trains_it(tok):
    traj, engine = _play(tok, ContextConfig(policy="compact", keep_last_turns=1), max_total_tokens=900)
    assert traj.stop_reason == StopReason.TERMINATED and traj.reward == 1.0
    assert traj.metrics["context/summaries"] == len(traj.context_segments) >= 1
    assert engine.summary_caps == [128] * len(traj.context_segments)  # every summary may use its whole cap
    _sampled_once(traj, engine)
    for seg in traj.context_segments:
        last = seg.messages[-2:]
        assert last[0]["role"] == "user" and last[0]["content"].startswith("The conversation is about to run out")
        assert last[1] == {"role": "assistant", "content": engine.summary}
    for seg in traj.segments[1:]:
        assert any(m["role"] == "user" and m["content"].startswith("Summary of the episode so far")
                   and m["content"].endswith(engine.summary) for m in seg.messages)


@pytest.mark.parametrize(("summary", "finish", "why"), [
    ("", "stop", "the summary is empty"),
    (CALL.format(k=9), "stop", "the summary holds a tool call ('read')"),
    ("a long summary", "length", "the summary was cut at"),
])
def test_a_failed_summary_ends_the_episode_with_its_reason(tok, summary, finish, why):
    traj, _ = _play(tok, ContextConfig(policy="compact"), engine=ScriptedEngine(tok, summary, finish), max_total_tokens=900)
    assert traj.stop_reason == StopReason.SUMMARY_FAILED and traj.trainable and traj.error is None
    assert traj.env_reason.startswith(f"rollout.context: {why}")
    assert traj.context_segments == () and traj.turns[-1].token_ids == tuple(
        tok(summary, add_special_tokens=False)["input_ids"])  # the summary is the context's last, trained turn


def test_caps_on_segments_and_sampled_tokens(tok):
    traj, _ = _play(tok, ContextConfig(policy="drop_oldest", max_segments=2), env=PagesEnv(pages=30))
    assert traj.stop_reason == StopReason.MAX_SEGMENTS and len(traj.segments) == 2
    traj, engine = _play(tok, ContextConfig(policy="drop_oldest", max_sampled_tokens=100), env=PagesEnv(pages=30))
    assert traj.stop_reason == StopReason.MAX_SAMPLED_TOKENS and traj.episode_policy_tokens == 100
    assert sum(len(r) for r in engine.replies) == 100


def test_every_context_trains_once_with_the_episodes_advantage(tok):
    traj, _ = _play(tok, ContextConfig(policy="drop_oldest"))
    other, _ = _play(tok, None)
    slim = [traj.for_records(), other.for_records()]
    fields = R.trajectory_fields(slim)
    fields[R.ADVANTAGE] = [np.float32(0.5), np.float32(-0.5)]
    fields[R.TRAINABLE] = np.asarray([True, True])
    out, contexts, side = with_segments(fields, side_branches=False)
    n = len(traj.context_segments)
    assert (contexts, side) == (n, 0) and len(out[R.TOKEN_IDS]) == 2 + n
    assert [float(a) for a in out[R.ADVANTAGE]] == [0.5, -0.5] + [0.5] * n
    for row, seg in zip(out[R.TOKEN_IDS][2:], traj.context_segments, strict=True):
        assert list(row) == list(seg.token_ids)
    batch = collate_fields(out, tok.pad_token_id or 0)
    assert int(batch.loss_mask.sum()) == traj.episode_policy_tokens + other.episode_policy_tokens
    assert int(fields[R.POLICY_TOKENS][0]) == traj.episode_policy_tokens
    assert int(R.episode_fields(slim)[R.TURNS][0]) == sum(len(s.turns) for s in traj.segments)
    fields[R.TRAINABLE] = np.asarray([False, True])  # a failed episode trains no context
    assert with_segments(fields, side_branches=False)[1] == 0


def test_each_context_is_a_token_record_line_that_replays(tok, tmp_path):
    for policy in ("drop_oldest", "compact"):
        traj, _ = _play(tok, ContextConfig(policy=policy), max_total_tokens=900 if policy == "compact" else 600)
        out = tmp_path / policy
        write_token_record(out / "rollouts" / "tokens" / "step_000001.jsonl.gz", [(traj, 3)])
        records = load_token_record(out, 1)
        assert [r["sample_id"] for r in records] == [s.sample_id for s in traj.segments]
        assert [r["stop_reason"] for r in records][:-1] == ["context"] * len(traj.context_segments)
        reports = replay_records(records, ChatRenderer(tok, tool_example=False), None, 1.0, 2e-3)
        assert [r.divergence for r in reports] == [None] * len(records)
        write_rollout_dump(out / "dump.jsonl", [(traj.for_records(), 3)], 4, {traj.sample_id}, set(), tok.decode)
        rows = [json.loads(line) for line in (out / "dump.jsonl").read_text().splitlines()]
        assert [(r.get("context_of"), r.get("segment"), r["trained"]) for r in rows] == \
            [("g/0", k, True) for k in range(len(traj.context_segments))] + [(None, None, True)]


def test_a_diverging_context_names_itself(tok, tmp_path):
    traj, _ = _play(tok, ContextConfig(policy="drop_oldest"))
    write_token_record(tmp_path / "rollouts" / "tokens" / "step_000001.jsonl.gz", [(traj, 3)])
    records = load_token_record(tmp_path, 1)
    first = records[0]
    assert len(first["turns"]) >= 2 and first["sample_id"] == "g/0/ctx0"
    obs_at = first["turns"][0]["start"] + len(first["turns"][0]["token_ids"])
    first["token_ids"][obs_at + 2] += 1  # a changed observation token after the first context's first turn
    reports = replay_records(records, ChatRenderer(tok, tool_example=False), None, 1.0, 2e-3)
    bad = [(r.sample_id, r.divergence.check, r.divergence.turn) for r in reports if r.divergence is not None]
    assert bad == [("g/0/ctx0", "observation delta", 1)]


def test_an_evaluation_sample_holds_every_contexts_replies(tok):
    from relax_agent.evaluation import sample_record

    traj, engine = _play(tok, ContextConfig(policy="compact"), max_total_tokens=900)
    row = sample_record(traj, {"id": "t0"}, 0, None)
    assert [c["sample_id"] for c in row["contexts"]] == [s.sample_id for s in traj.segments]
    assert row["response"] == [tok.decode(r, skip_special_tokens=True) for r in engine.replies]
    assert sum(text == engine.summary for text in row["response"]) == len(traj.context_segments)
