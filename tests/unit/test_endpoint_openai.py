"""The agent endpoint through the real ``openai`` SDK on 127.0.0.1: plain, tools, tool_choice, n,
streaming, logprobs, refusals and retry replay, against the tiny model or a scripted engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from relax_agent.config import ModelConfig
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import build_parser
from relax_agent.rollout.proxy.server import EndpointServer
from relax_agent.rollout.proxy.session import AgentSession

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
_keys = itertools.count()


class ScriptedEngine:
    """Replies with fixed token ids, streaming each through ``on_token`` like the HF engine."""

    def __init__(self, replies, delay_s: float = 0.0):
        self.replies = replies
        self.delay_s = delay_s
        self.prompts: list[list[int]] = []
        self.cancelled = 0
        self.policy_version = 0

    async def generate(self, prompt_ids, params: SamplingParams, on_token=None) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.replies(prompt_ids) if callable(self.replies) else self.replies
        out = []
        try:
            for t in ids[:params.max_new_tokens]:
                await asyncio.sleep(self.delay_s)
                out.append(t)
                if on_token is not None:
                    on_token(t, -0.25, 0)
                if t == 2:
                    break
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Generation(tuple(out), tuple(-0.25 for _ in out), "stop" if out[-1] == 2 else "length", 0)

    def load_weights(self, state_dict, version):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from relax_agent.models import load_policy
    from relax_agent.rollout.engines.config import EngineConfig
    from relax_agent.rollout.engines.hf import HFEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels with more threads round differently under load; seeds must reproduce
    model, tok = load_policy(ModelConfig(path=str(tiny_model_dir)))
    engine = HFEngine(model, tok, EngineConfig(max_batch_size=8, batch_wait_s=0.002))
    yield engine, tok
    engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    srv = EndpointServer().start()
    yield srv
    srv.close()


def open_session(server, engine, tok, max_new_tokens=48, max_total_tokens=1024, **kw):
    key = f"test-key-{next(_keys)}"
    spec = EpisodeSpec(f"s{key}", "g", "t", {}, seed=1, max_total_tokens=max_total_tokens)
    session = AgentSession(spec, key, engine, ChatRenderer(tok), build_parser("hermes"),
                           SamplingParams(max_new_tokens=max_new_tokens), **kw)
    server.open(session)
    return session, openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [2]


USER = [{"role": "user", "content": "What is 1 + 2?"}]


def test_plain_completion_returns_what_was_sampled(server, policy):
    engine, tok = policy
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="anything", messages=USER)
    turn = session.primary.rec.turns[0]
    assert out.choices[0].message.content == tok.decode(turn.token_ids, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(turn.token_ids)
    assert out.usage.prompt_tokens == turn.start
    assert out.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list().data] == ["policy"]


def test_logprobs_are_the_recorded_ones(server, policy):
    engine, tok = policy
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="m", messages=USER, logprobs=True)
    turn = session.primary.rec.turns[0]
    got = [e.logprob for e in out.choices[0].logprobs.content]
    assert got == pytest.approx(list(turn.logprobs))
    assert all(lp < 0 for lp in got)


def test_tool_calls_are_parsed_into_openai_tool_calls(server, policy):
    _, tok = policy
    session, client = open_session(server, ScriptedEngine(ids_of(tok, CALL_TEXT)), tok)
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert choice.message.content is None
    assert session.stats.tool_parse_failures == 0


def test_tool_choice_none_returns_the_text(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, CALL_TEXT)), tok)
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == CALL_TEXT


@pytest.mark.parametrize("choice, forced", [
    ({"type": "function", "function": {"name": "add"}}, '<tool_call>\n{"name": "add", "arguments": '),
    ("required", '<tool_call>\n{"name": "'),
])
def test_tool_choice_forces_the_call_opening(server, policy, choice, forced):
    _, tok = policy
    rest = CALL_TEXT[len(forced):]
    engine = ScriptedEngine(ids_of(tok, rest))
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    forced_ids = tok(forced, add_special_tokens=False)["input_ids"]
    assert engine.prompts[0][-len(forced_ids):] == forced_ids
    rec = session.primary.rec
    start = rec.turns[0].start
    assert rec.loss_mask[start - len(forced_ids):start] == [0] * len(forced_ids)  # forced tokens are context


def test_tool_choice_naming_an_unknown_function_is_refused(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "mul"}})
    assert err.value.body["param"] == "tool_choice" and "mul" in err.value.body["message"]


def test_parallel_tool_calls_false_stops_after_the_first_call(server, policy):
    _, tok = policy
    engine = ScriptedEngine(ids_of(tok, CALL_TEXT + "\n" + CALL_TEXT))
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1
    text = tok.decode(session.primary.rec.turns[0].token_ids)
    assert text.count("</tool_call>") == 1 and text.rstrip().endswith("</tool_call>")


def test_parse_failure_is_returned_as_content_and_counted(server, policy):
    _, tok = policy
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    session, client = open_session(server, ScriptedEngine(ids_of(tok, bad)), tok)
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == bad
    assert session.metrics()["agent/tool_parse_failures"] == 1.0


def test_stop_strings_end_the_reply(server, policy):
    _, tok = policy
    engine = ScriptedEngine(ids_of(tok, "alpha beta STOP gamma delta"))
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="m", messages=USER, stop=["STOP"])
    assert out.choices[0].message.content == "alpha beta "
    assert out.choices[0].finish_reason == "stop"
    assert "gamma" not in tok.decode(session.primary.rec.turns[0].token_ids)


def test_n4_gives_four_sibling_segments_of_one_prompt(server, policy):
    engine, tok = policy
    session, client = open_session(server, engine, tok)
    out = client.chat.completions.create(model="m", messages=USER, n=4, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in out.choices}) > 1
    recs = session.recorders()
    assert len(recs) == 4 and session.stats.siblings == 3
    starts = {rec.turns[0].start for rec in recs}
    prompts = {tuple(rec.token_ids[:rec.turns[0].start]) for rec in recs}
    assert len(starts) == 1 and len(prompts) == 1
    for rec, choice in zip(recs, out.choices, strict=True):
        assert tok.decode(rec.turns[0].token_ids, skip_special_tokens=True) == choice.message.content


def _streamed(client, **kw):
    content, calls, finish, chunks = [], {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        chunks += 1
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, chunks


def test_streamed_text_equals_the_non_streamed_answer_under_one_seed(server, policy):
    engine, tok = policy
    _, client = open_session(server, engine, tok, max_new_tokens=24)
    plain = client.chat.completions.create(model="m", messages=USER, seed=7).choices[0]
    _, client2 = open_session(server, engine, tok, max_new_tokens=24)
    text, calls, finish, chunks = _streamed(client2, model="m", messages=USER, seed=7)
    assert text == plain.message.content and finish == plain.finish_reason and not calls
    assert chunks > 3  # token by token, not one chunk at the end


def test_streamed_tool_call_deltas_equal_the_non_streamed_answer(server, policy):
    _, tok = policy
    reply = ids_of(tok, "Let me add.\n" + CALL_TEXT)
    _, client = open_session(server, ScriptedEngine(reply), tok)
    plain = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0]
    _, client2 = open_session(server, ScriptedEngine(reply, delay_s=0.001), tok)
    text, calls, finish, _ = _streamed(client2, model="m", messages=USER, tools=TOOLS)
    assert text == plain.message.content == "Let me add."
    assert finish == "tool_calls" == plain.finish_reason
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in plain.message.tool_calls]


@pytest.mark.parametrize("extra, param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"temperature": 0.3}, "temperature"),
    ({"temperature": 0}, "temperature"),
    ({"n": 0}, "n"),
    ({"made_up_field": 1}, "made_up_field"),
])
def test_unsupported_fields_get_400_naming_the_field(server, policy, extra, param):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, extra_body=extra)
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_a_conversation_past_the_token_budget_is_refused(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok, max_total_tokens=40)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 60}])
    assert err.value.body["code"] == "context_length_exceeded"


def test_unknown_key_gets_401(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=USER)


def test_an_sdk_retry_replays_the_recorded_answer(server, policy):
    _, tok = policy
    engine = ScriptedEngine(ids_of(tok, "slow answer"), delay_s=0.4)  # ~1.6 s per reply
    key = f"test-key-{next(_keys)}"
    session = AgentSession(EpisodeSpec("r", "g", "t", {}, seed=1), key, engine, ChatRenderer(tok),
                           build_parser("hermes"), SamplingParams(max_new_tokens=12))
    server.open(session)
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=8, timeout=0.5)
    out = client.chat.completions.create(model="m", messages=USER)  # times out, retried until answered
    assert out.choices[0].message.content == "slow answer"
    assert len(engine.prompts) == 1  # sampled once; retries waited for (then replayed) that sample
    assert session.stats.replayed >= 1
    body = {"model": "m", "messages": USER}
    headers = {"Authorization": f"Bearer {key}", "x-stainless-retry-count": "1"}
    again = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=30)
    fresh = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=30)
    assert again.json()["id"] == out.id and len(engine.prompts) == 2  # a first attempt is sampled anew
    assert fresh.json()["id"] != out.id


# -- request hygiene: body cap, error bodies, models.retrieve, tool_choice, tool_call_id, max_tokens ------


def test_a_body_over_the_cap_gets_413_and_the_episode_beside_it_is_served(policy):
    _, tok = policy
    srv = EndpointServer(max_request_bytes=4096).start()
    try:
        _, big = open_session(srv, ScriptedEngine(ids_of(tok, "x")), tok)
        _, good = open_session(srv, ScriptedEngine(ids_of(tok, "fine")), tok)
        with pytest.raises(openai.APIStatusError) as err:
            big.chat.completions.create(model="m", messages=[{"role": "user", "content": "y" * 10_000}])
        assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
        assert "4096" in err.value.body["message"]
        chunked = httpx.post(f"{srv.base_url}/chat/completions", headers={"Authorization": f"Bearer {big.api_key}"},
                             content=(b"x" * 1024 for _ in range(8)), timeout=30)  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        assert good.chat.completions.create(model="m", messages=USER).choices[0].message.content == "fine"
    finally:
        srv.close()


def test_404_and_405_carry_openai_error_bodies(server):
    missing = httpx.get(f"{server.base_url}/nothing", timeout=10)
    wrong = httpx.get(f"{server.base_url}/chat/completions", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert "/v1/nothing" in missing.json()["error"]["message"]
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


def test_models_retrieve_through_the_sdk(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    model = client.models.retrieve("policy")
    assert model.id == "policy" and model.object == "model" and model.owned_by == "relax-agent"
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"  # requests may name any model


def test_a_tool_result_for_an_unknown_call_id_is_refused(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", tools=TOOLS, messages=USER + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_9", "content": "3"}])
    assert err.value.body["param"] == "messages[2].tool_call_id" and "call_9" in err.value.body["message"]


def test_tool_choice_required_never_returns_a_reply_without_a_call(server, policy):
    _, tok = policy
    good = 'add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    engine = ScriptedEngine(lambda prompt: ids_of(tok, "no call here" if len(engine.prompts) == 1 else good))
    session, client = open_session(server, engine, tok)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required")
    assert err.value.body["code"] == "invalid_tool_call" and err.value.body["param"] == "tool_choice"
    out = client.with_options(max_retries=1).chat.completions.create(
        model="m", messages=USER, tools=TOOLS, tool_choice="required")  # a request that resamples
    assert out.choices[0].message.tool_calls[0].function.name == "add"
    assert session.final_reply().content == "" and session.metrics()["agent/undelivered"] == 1.0


def test_max_tokens_over_the_budget_is_capped_with_a_header_or_refused(server, policy):
    _, tok = policy
    session, client = open_session(server, ScriptedEngine(ids_of(tok, "word " * 40)), tok, max_new_tokens=8)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=USER, max_tokens=500)
    assert raw.headers["x-relax-max-tokens"] == "8"
    assert raw.parse().usage.completion_tokens == 8 and session.metrics()["agent/capped_max_tokens"] == 1.0
    plain = client.chat.completions.with_raw_response.create(model="m", messages=USER, max_tokens=4)
    assert "x-relax-max-tokens" not in plain.headers
    _, strict = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok, max_new_tokens=8,
                             max_tokens_over_budget="refuse")
    with pytest.raises(openai.BadRequestError) as err:
        strict.chat.completions.create(model="m", messages=USER, max_tokens=500)
    assert err.value.body["param"] == "max_tokens" and err.value.body["code"] == "max_tokens_exceeded"


def test_an_out_of_range_seed_is_refused(server, policy):
    _, tok = policy
    _, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, seed=2**70)
    assert err.value.body["param"] == "seed"


def test_a_closed_stream_aborts_its_generation(server, policy):
    _, tok = policy
    engine = ScriptedEngine(ids_of(tok, "word " * 40), delay_s=0.1)  # ~4 s of sampling
    session, client = open_session(server, engine, tok)
    stream = client.chat.completions.create(model="m", messages=USER, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 3.0
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cancelled == 1  # aborted well before the reply's end
    assert session.stats.aborted == 1 and session.replies == []  # nothing of it is recorded


def test_logprob_bytes_of_tokens_that_split_a_character_join_to_the_text(server, policy):
    _, tok = policy
    text = "ok 🦜 漢字のテスト"
    ids = ids_of(tok, text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some tokens hold part of a character
    _, client = open_session(server, ScriptedEngine(ids), tok)
    out = client.chat.completions.create(model="m", messages=USER, logprobs=True)
    entries = out.choices[0].logprobs.content
    assert len(entries) == len(ids)
    assert bytes(b for e in entries[:-1] for b in e.bytes).decode() == text == out.choices[0].message.content


def test_the_episode_token_cap_holds_across_requests(server, policy):
    _, tok = policy
    session, client = open_session(server, ScriptedEngine(ids_of(tok, "word " * 40)), tok, max_new_tokens=8,
                                   max_sampled_tokens=12)
    first = client.chat.completions.with_raw_response.create(model="m", messages=USER)
    assert first.parse().usage.completion_tokens == 8 and "x-relax-max-tokens" not in first.headers
    second = client.chat.completions.with_raw_response.create(model="m", messages=USER)
    assert second.headers["x-relax-max-tokens"] == "4" and second.parse().usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER)
    assert err.value.body["code"] == "episode_token_budget_exceeded" and "12" in err.value.body["message"]
    assert sum(r.num_tokens for r in session.replies) == 12


def test_a_huge_history_does_not_stall_another_episode(policy):
    _, tok = policy
    srv = EndpointServer(max_request_bytes=8 * 1024 * 1024).start()
    try:
        big_session, big = open_session(srv, ScriptedEngine(ids_of(tok, "x")), tok, max_total_tokens=10**7)
        _, small = open_session(srv, ScriptedEngine(ids_of(tok, "fine")), tok)
        planned_at: list[float] = []
        plan = big_session._plan
        big_session._plan = lambda req: (plan(req), planned_at.append(time.monotonic()))[0]
        worker = threading.Thread(target=lambda: big.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "lorem ipsum dolor sit amet, " * 50_000}]))
        worker.start()
        while big_session.stats.requests == 0:  # the big request is being tokenized
            time.sleep(0.01)
        for _ in range(3):
            assert small.chat.completions.create(model="m", messages=USER).choices[0].message.content == "fine"
        small_done = time.monotonic()
        worker.join(120)
        assert planned_at and small_done < planned_at[0], "the small episode waited for the big one's tokenization"
    finally:
        srv.close()


def test_streaming_decodes_each_token_once_not_the_whole_reply_per_token(server, policy):
    _, tok = policy
    reply = ids_of(tok, "word " * 600 + "🦜 end")
    session, client = open_session(server, ScriptedEngine(reply), tok, max_new_tokens=1000)
    decoded = [0]
    decode = session._decode
    session._decode = lambda ids: (decoded.__setitem__(0, decoded[0] + len(ids)), decode(ids))[1]
    text, _, _, _ = _streamed(client, model="m", messages=USER)
    assert text == "word " * 600 + "🦜 end"
    assert decoded[0] < 12 * len(reply)  # re-decoding the reply per token: ~len(reply)**2 / 2


def test_response_ids_are_opaque_and_unique(server, policy):
    _, tok = policy
    session, client = open_session(server, ScriptedEngine(ids_of(tok, "x")), tok)
    ids = [client.chat.completions.create(model="m", messages=USER).id for _ in range(2)]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-") for i in ids)
    assert not any(session.key[-6:] in i or session.key[:6] in i for i in ids)  # nothing of the key leaks
