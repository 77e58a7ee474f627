"""Token-in/token-out through the agent endpoint: history sent back verbatim reuses the sampled ids
(nothing re-tokenized); rewritten history starts a branch, and no segment is corrupted."""

from __future__ import annotations

import json

import openai
import pytest

from relax_agent.config import ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.proxy.server import EndpointServer
from tests.unit.test_endpoint_openai import TOOLS, ScriptedEngine, open_session

USER = [{"role": "user", "content": "Compute 1 + 2."}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def server():
    srv = EndpointServer().start()
    yield srv
    srv.close()


def _odd_ids(tok, *pieces):
    """Token ids of ``pieces`` tokenized one by one: not how the tokenizer splits their concatenation."""
    return [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]] + [2]


def test_history_sent_back_verbatim_keeps_the_sampled_ids(server, tok):
    call = _odd_ids(tok, "<tool_", "call>\n", '{"name": "add", "argu', 'ments": {"a": 1, "b": 2}}\n</tool_call>')
    answer = _odd_ids(tok, "Ans", "wer: ", "3")
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, client = open_session(server, engine, tok)
    messages = list(USER)
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    assert first.tool_calls and first.tool_calls[0].function.name == "add"
    messages.append(first.model_dump(exclude_none=True))
    tool_msg = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "3"}
    messages.append(tool_msg)
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    assert second.content == "Answer: 3"

    renderer = ChatRenderer(tok)
    prompt = list(renderer.render_prompt(USER, TOOLS).token_ids)
    delta = renderer.observation_delta([tool_msg], closed=True)
    rec = session.primary.rec
    assert rec.token_ids == prompt + call + delta + answer
    assert rec.loss_mask == [0] * len(prompt) + [1] * len(call) + [0] * len(delta) + [1] * len(answer)
    assert [list(t.token_ids) for t in rec.turns] == [call, answer]
    assert engine.prompts[1] == prompt + call + delta  # the engine saw the sampled ids, not a re-render
    assert session.stats.branches == 0 and len(session.recorders()) == 1
    assert tok(tok.decode(call[:-1]), add_special_tokens=False)["input_ids"] != call[:-1]  # re-tokenizing would differ


def test_rewritten_history_starts_a_branch_and_keeps_both_segments_intact(server, tok):
    replies = [_odd_ids(tok, "first ", "reply"), _odd_ids(tok, "second"), _odd_ids(tok, "third")]
    engine = ScriptedEngine(lambda prompt: replies[len(engine.prompts) - 1])
    session, client = open_session(server, engine, tok)
    first = client.chat.completions.create(model="m", messages=USER).choices[0].message
    edited = USER + [{"role": "assistant", "content": "a summary of what was said"},  # holds no reply: a branch
                     {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="m", messages=edited)
    verbatim = USER + [first.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="m", messages=verbatim)  # continues the first segment

    renderer = ChatRenderer(tok)
    assert session.stats.branches == 1
    segments = {seg.kind: seg.rec for seg in session.segments}
    prompt = list(renderer.render_prompt(USER).token_ids)
    delta = renderer.observation_delta([{"role": "user", "content": "go on"}], closed=True)
    assert segments["first"].token_ids == prompt + replies[0] + delta + replies[2]
    assert segments["branch"].token_ids == list(renderer.render_prompt(edited).token_ids) + replies[1]
    for rec in session.recorders():
        traj = rec.finish(0.0, {}, "terminated")
        for turn in traj.turns:
            assert list(traj.token_ids[turn.start:turn.start + len(turn.token_ids)]) == list(turn.token_ids)
            assert set(traj.loss_mask[turn.start:turn.start + len(turn.token_ids)]) == {1}
        assert sum(traj.loss_mask) == sum(len(t.token_ids) for t in traj.turns)
    assert session.primary is session.segments[0]  # the last request continued the first segment


def test_an_earlier_turn_resent_forks_from_its_exact_tokens(server, tok):
    replies = [_odd_ids(tok, "one"), _odd_ids(tok, "two"), _odd_ids(tok, "three")]
    engine = ScriptedEngine(lambda prompt: replies[len(engine.prompts) - 1])
    session, client = open_session(server, engine, tok)
    first = client.chat.completions.create(model="m", messages=USER).choices[0].message
    history = USER + [first.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    client.chat.completions.create(model="m", messages=history)
    client.chat.completions.create(model="m", messages=history)  # the same state once more: a fork after turn 1
    assert engine.prompts[1] == engine.prompts[2]
    assert session.stats.branches == 1
    a, b = (seg.rec for seg in session.segments)
    n = len(engine.prompts[1])
    assert a.token_ids[:n] == b.token_ids[:n] and a.token_ids[n:] != b.token_ids[n:]


def test_tools_changed_mid_episode_render_afresh(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, "ok"))
    session, client = open_session(server, engine, tok)
    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0].message
    more = USER + [first.model_dump(exclude_none=True), {"role": "user", "content": "and now?"}]
    client.chat.completions.create(model="m", messages=more)  # no tools: not the rendering of segment one
    assert session.stats.branches == 0 and session.stats.continuations == 1  # a new context of the same chain
    assert json.loads(session.segments[1].tools_key) == []
    assert session.segments[1].replies[0].parent is session.segments[0].replies[0]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
