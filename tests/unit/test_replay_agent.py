"""Replay judges agent-driven episodes: an episode recorded by the agent endpoint (two chained
requests, the second sending the history back with a tool result) replays without divergence, its
observation delta is checked (not skipped), and a re-rendered history turn is found at its turn
and token."""

from __future__ import annotations

import copy
import json

import pytest

from relax_agent.config import ModelConfig
from relax_agent.control.reporting import write_token_record
from relax_agent.models import load_tokenizer
from relax_agent.replay import DELTA, load_token_record, replay_records
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.proxy.server import EndpointServer
from tests.unit.test_endpoint_openai import TOOLS, ScriptedEngine, open_session

USER = [{"role": "user", "content": "Compute 1 + 2."}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def recorded(tok, tmp_path_factory):
    """An agent episode of two requests (a tool call, then the answer), through the endpoint, in a token record."""
    call = tok('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [2]
    answer = tok("The sum is 3.", add_special_tokens=False)["input_ids"] + [2]
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    server = EndpointServer().start()
    try:
        session, client = open_session(server, engine, tok)
        messages = list(USER)
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(first.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "3"})
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    finally:
        server.close()
    traj = session.trained().finish(1.0, {}, "terminated")
    run = tmp_path_factory.mktemp("agent_replay")
    path = run / "rollouts" / "tokens" / "step_000001.jsonl.gz"
    write_token_record(path, [(traj, 0)])
    (rec,) = load_token_record(run, 1)
    return rec


def test_the_record_lines_each_turn_up_with_its_message(recorded):
    msgs = recorded["messages"]
    first, second = (t["message"] for t in recorded["turns"])
    assert msgs[first - 1] == USER[0] and second == first + 2
    assert [msgs[i]["role"] for i in (first, first + 1, second)] == ["assistant", "tool", "assistant"]
    assert msgs[first]["tool_calls"][0]["function"]["name"] == "add"  # the parsed reply, not the sampled text
    assert [t["closed"] for t in recorded["turns"]] == [True, True]
    assert [t["opening"] for t in recorded["turns"]] == [0, 0]


def test_an_agent_episode_replays_and_its_delta_is_checked(recorded, tok):
    (rep,) = replay_records([recorded], ChatRenderer(tok), None, 1.0, 2e-3)
    assert rep.divergence is None and rep.turns == 2
    assert DELTA not in rep.skipped  # judged, not skipped as before
    # the old text matching could not line the parsed reply up: the message index is what makes it judgeable
    old = copy.deepcopy(recorded)
    for t in old["turns"]:
        t["message"] = None
    (rep,) = replay_records([old], ChatRenderer(tok), None, 1.0, 2e-3)
    assert rep.skipped[DELTA] == "messages do not line up with the turns"


def test_a_re_rendered_history_turn_is_found_at_its_turn_and_token(recorded, tok):
    renderer = ChatRenderer(tok)
    t1, t2 = recorded["turns"]
    end = t1["start"] + len(t1["token_ids"])
    delta = renderer.observation_delta([recorded["messages"][t1["message"] + 1]], closed=True)
    assert recorded["token_ids"][end:t2["start"]] == delta
    # the agent's history re-rendered: the tool result's text tokenized anew, one token split in two
    bad = copy.deepcopy(recorded)
    at = end + next(i for i, t in enumerate(delta) if len(tok.decode([t])) > 1)
    piece = tok.decode([bad["token_ids"][at]])
    split = tok(piece[0], add_special_tokens=False)["input_ids"] + tok(piece[1:], add_special_tokens=False)["input_ids"]
    bad["token_ids"][at:at + 1] = split
    shift = len(split) - 1
    bad["loss_mask"][at:at + 1] = [0] * len(split)
    bad["rollout_logprobs"][at:at + 1] = [0.0] * len(split)
    bad["turns"][1]["start"] += shift
    (rep,) = replay_records([bad], renderer, None, 1.0, 2e-3)
    d = rep.divergence
    assert (d.check, d.turn, d.token) == (DELTA, 1, at)
    assert (d.expected, d.recorded) == (recorded["token_ids"][at], split[0])
    assert json.dumps(d.expected) and "observation delta at turn 1" in d.describe(tok.decode)


def test_a_forced_tool_call_opening_is_left_out_of_the_delta(tok, tmp_path):
    """tool_choice="required" appends the call's opening as context before the turn: recorded as the
    turn's ``opening``, not compared with the re-rendered delta, which is still checked."""
    call = tok('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [2]
    rest = tok('add", "arguments": {"a": 3, "b": 4}}\n</tool_call>', add_special_tokens=False)["input_ids"] + [2]
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else rest)
    server = EndpointServer().start()
    try:
        session, client = open_session(server, engine, tok)
        messages = list(USER)
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages += [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "3"}]
        second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required")
        assert second.choices[0].message.tool_calls[0].function.arguments == '{"a": 3, "b": 4}'
    finally:
        server.close()
    write_token_record(tmp_path / "rollouts" / "tokens" / "step_000001.jsonl.gz",
                       [(session.trained().finish(0.0, {}, "truncated"), 0)])
    (rec,) = load_token_record(tmp_path, 1)
    opening = rec["turns"][1]["opening"]
    assert opening == len(tok('<tool_call>\n{"name": "', add_special_tokens=False)["input_ids"]) > 0
    (rep,) = replay_records([rec], ChatRenderer(tok), None, 1.0, 2e-3)
    assert rep.divergence is None and rep.skipped == {"log-probs": "not asked (--no-logprobs)"}
    end = rec["turns"][0]["start"] + len(rec["turns"][0]["token_ids"])
    rec["token_ids"][end + 1] += 1  # a delta token, before the opening: still found
    (rep,) = replay_records([rec], ChatRenderer(tok), None, 1.0, 2e-3)
    assert (rep.divergence.check, rep.divergence.turn, rep.divergence.token) == (DELTA, 1, end + 1)


def test_an_edited_turn_log_prob_is_a_divergence_that_prints(recorded, tok):
    """It crashed the report with a TypeError (a log-prob decoded as a token id)."""
    from relax_agent.replay import TURN_LOGPROBS

    rec = copy.deepcopy(recorded)
    t2 = rec["turns"][1]
    rec["rollout_logprobs"][t2["start"] + 1] += 0.5
    (rep,) = replay_records([rec], ChatRenderer(tok), None, 1.0, 2e-3)
    div = rep.divergence
    assert (div.check, div.turn, div.token) == (TURN_LOGPROBS, 2, t2["start"] + 1)
    assert div.expected == t2["logprobs"][1] and div.recorded == pytest.approx(t2["logprobs"][1] + 0.5)
    assert div.describe(tok.decode).startswith(f"turn log-probs at turn 2, token {t2['start'] + 1}: expected ")


def test_a_removed_assistant_message_is_a_divergence_not_a_skip(recorded, tok):
    from relax_agent.replay import MESSAGES

    rec = copy.deepcopy(recorded)
    second = rec["turns"][1]["message"]
    del rec["messages"][second]
    (rep,) = replay_records([rec], ChatRenderer(tok), None, 1.0, 2e-3)
    assert rep.divergence is not None and rep.divergence.check == MESSAGES
    found = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
    assert second not in found and rep.divergence.recorded == f"assistant messages at {found}"
    assert rep.divergence.expected == f"assistant messages at {[t['message'] for t in rec['turns']]} (one per turn)"


def _write(path, payload: bytes):
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload))


@pytest.mark.parametrize("payload, says", [
    (b"", "holds no episode"),
    (b"\n\n", "holds no episode"),
    (b'{"sample_id": "a"}\n', "line 1: not an episode record (missing ['sample_version'"),
    (b"[1, 2]\n", "line 1: not an episode record"),
    (b"not json\n", "line 1: unreadable (JSONDecodeError"),
])
def test_a_broken_record_is_an_error_naming_file_and_line(tmp_path, payload, says):
    from relax_agent.errors import DataError
    from relax_agent.replay import token_record_path

    path = token_record_path(tmp_path, 3)
    _write(path, payload)
    with pytest.raises(DataError) as err:
        load_token_record(tmp_path, 3)
    assert str(path) in str(err.value) and says in str(err.value)


def test_a_cut_record_names_the_line_it_was_cut_in(recorded, tmp_path):
    import gzip

    from relax_agent.errors import DataError
    from relax_agent.replay import token_record_path

    path = token_record_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    whole = gzip.compress((json.dumps(recorded) + "\n").encode() * 2)
    path.write_bytes(whole[: len(whole) - 40])
    with pytest.raises(DataError, match=r"step_000001.jsonl.gz, line \d+: unreadable \((EOFError|BadGzipFile|OSError)"):
        load_token_record(tmp_path, 1)


def test_replay_of_an_empty_record_exits_non_zero(tmp_path):
    from typer.testing import CliRunner

    from relax_agent.cli import app
    from relax_agent.replay import token_record_path

    _write(token_record_path(tmp_path, 1), b"")
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  output_dir: out\n")
    out = CliRunner().invoke(app, ["replay", str(config), "--step", "1", "--run", str(tmp_path)])
    assert out.exit_code != 0 and "holds no episode: nothing to replay" in out.output
