"""The OpenAI Responses API (``/v1/responses``) and Anthropic Messages (``/v1/messages``) through the
official ``openai`` and ``anthropic`` SDKs on 127.0.0.1: a tool-call round trip (plain and
streamed) is one chained episode whose trained tokens are exactly the sampled ones, the streamed
events are the ones each SDK parses, and refusals come in each API's error shape."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from relax_agent.config import ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.proxy.server import EndpointServer
from tests.unit.test_endpoint_openai import TOOLS, ScriptedEngine, open_session

USER = [{"role": "user", "content": "Compute 1 + 2."}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers.",
                    "parameters": TOOLS[0]["function"]["parameters"]}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add two numbers.", "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def server():
    srv = EndpointServer().start()
    yield srv
    srv.close()


def _odd_ids(tok, *pieces):
    """Token ids of ``pieces`` tokenized one by one: not how the tokenizer splits their concatenation
    (a re-tokenized history would differ from them)."""
    return [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]] + [2]


def _call_then_answer(tok):
    call = _odd_ids(tok, "<tool_", "call>\n", '{"name": "add", "argu', 'ments": {"a": 1, "b": 2}}\n</tool_call>')
    answer = _odd_ids(tok, "Ans", "wer: ", "3")
    assert tok(tok.decode(call[:-1]), add_special_tokens=False)["input_ids"] != call[:-1]
    return call, answer


def _assert_one_chain(session, tok, call, answer, tool_msg, engine):
    """The episode is one chain: prompt, the sampled call, the tool result's template delta, the
    sampled answer; trained tokens (loss mask 1) are exactly the sampled ones."""
    renderer = ChatRenderer(tok)
    prompt = list(renderer.render_prompt(USER, TOOLS).token_ids)
    delta = renderer.observation_delta([tool_msg], closed=True)
    rec = session.trained()
    assert rec.token_ids == prompt + call + delta + answer
    assert rec.loss_mask == [0] * len(prompt) + [1] * len(call) + [0] * len(delta) + [1] * len(answer)
    assert [list(t.token_ids) for t in rec.turns] == [call, answer]
    assert engine.prompts[1] == prompt + call + delta  # the engine saw the sampled ids, not a re-render
    assert session.stats.branches == 0 and len(session.recorders()) == 1
    metrics = session.metrics()
    assert metrics["agent/chain_replies"] == 2.0 and metrics["agent/dropped_replies"] == 0.0


def _anthropic(server, session, **kw):
    return anthropic.Anthropic(base_url=server.root_url, api_key=session.key, max_retries=0, timeout=60, **kw)


# -- /v1/responses -------------------------------------------------------------------------------


def test_responses_tool_round_trip_is_one_chain_of_the_sampled_tokens(server, tok):
    call, answer = _call_then_answer(tok)
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, client = open_session(server, engine, tok)
    first = client.responses.create(model="m", input=USER, tools=RESPONSES_TOOLS)
    assert first.object == "response" and first.status == "completed"
    assert [item.type for item in first.output] == ["function_call"]
    fc = first.output[0]
    assert fc.name == "add" and json.loads(fc.arguments) == {"a": 1, "b": 2}
    assert first.usage.output_tokens == len(call) and first.usage.input_tokens == session.trained().turns[0].start

    second = client.responses.create(model="m", tools=RESPONSES_TOOLS, input=[
        *USER, *first.output, {"type": "function_call_output", "call_id": fc.call_id, "output": "3"}])
    assert second.output_text == "Answer: 3"
    assert [item.type for item in second.output] == ["message"]
    _assert_one_chain(session, tok, call, answer, {"role": "tool", "tool_call_id": fc.call_id, "content": "3"}, engine)


def test_responses_stream_events_and_round_trip(server, tok):
    call, answer = _call_then_answer(tok)
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, client = open_session(server, engine, tok)
    events = list(client.responses.create(model="m", input=USER, tools=RESPONSES_TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first = events[-1].response
    fc = first.output[0]
    assert fc.type == "function_call" and json.loads(fc.arguments) == {"a": 1, "b": 2}
    assert events[3].delta == events[4].arguments == fc.arguments and events[2].item.call_id == fc.call_id

    # the SDK's accumulating helper rebuilds the same response from the text deltas
    with client.responses.stream(model="m", tools=RESPONSES_TOOLS, input=[
            *USER, *first.output, {"type": "function_call_output", "call_id": fc.call_id, "output": "3"}]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Answer: 3"
    assert final.usage.output_tokens == len(answer)
    _assert_one_chain(session, tok, call, answer, {"role": "tool", "tool_call_id": fc.call_id, "content": "3"}, engine)


def test_responses_instructions_limits_and_refusals(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, "Ans", "wer: ", "3"))
    session, client = open_session(server, engine, tok)
    cut = client.responses.create(model="m", instructions="Be brief.", input="Compute 1 + 2.", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2
    prompt = ChatRenderer(tok).render_prompt([{"role": "system", "content": "Be brief."}, *USER]).token_ids
    assert engine.prompts[-1] == list(prompt)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert err.value.status_code == 400 and "stores no responses" in err.value.message
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", max_output_tokens=0)
    assert err.value.body["param"] == "max_output_tokens" and "max_output_tokens must be" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input=[*USER, {"type": "function_call_output", "call_id": "c9", "output": "3"}])
    assert err.value.body["param"] == "input[1].call_id" and "'c9'" in err.value.message
    with pytest.raises(openai.BadRequestError, match="built-in tools"):
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="text-only"):
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}])


# -- /v1/messages ----------------------------------------------------------------------------------


def test_messages_tool_round_trip_is_one_chain_of_the_sampled_tokens(server, tok):
    call, answer = _call_then_answer(tok)
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    first = client.messages.create(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.name == "add" and use.input == {"a": 1, "b": 2}
    assert first.usage.output_tokens == len(call)

    second = client.messages.create(model="m", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=[
        *USER, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == "Answer: 3"
    _assert_one_chain(session, tok, call, answer, {"role": "tool", "tool_call_id": use.id, "content": "3"}, engine)


def test_messages_stream_events_and_round_trip(server, tok):
    call, answer = _call_then_answer(tok)
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) <= 2 else answer)
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    raw = list(client.messages.create(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS, stream=True))
    assert [e.type for e in raw] == ["message_start", "content_block_start", "content_block_delta",
                                     "content_block_stop", "message_delta", "message_stop"]
    assert raw[2].delta.type == "input_json_delta" and raw[4].delta.stop_reason == "tool_use"
    assert raw[0].message.usage.input_tokens == raw[4].usage.input_tokens == len(engine.prompts[0])

    with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and first.content[0].input == {"a": 1, "b": 2}
    with client.messages.stream(model="m", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=[
            *USER, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                          "content": "3"}]}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == "Answer: 3" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(answer) and final.usage.input_tokens == len(engine.prompts[-1])


def test_messages_chain_through_a_streamed_round_trip(server, tok):
    call, answer = _call_then_answer(tok)
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS) as stream:
        first = stream.get_final_message()
    use = first.content[0]
    with client.messages.stream(model="m", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=[
            *USER, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]) as stream:
        assert "".join(stream.text_stream) == "Answer: 3"
    _assert_one_chain(session, tok, call, answer, {"role": "tool", "tool_call_id": use.id, "content": "3"}, engine)


def test_messages_stop_sequences_max_tokens_system_and_auth(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, "Ans", "wer: ", "3"))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    stopped = client.messages.create(model="m", max_tokens=64, messages=USER, stop_sequences=[": "],
                                     system="Be brief.")
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == ": "
    assert stopped.content[0].text == "Answer"
    prompt = ChatRenderer(tok).render_prompt([{"role": "system", "content": "Be brief."}, *USER]).token_ids
    assert engine.prompts[-1] == list(prompt)
    cut = client.messages.create(model="m", max_tokens=2, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    # Bearer works as well as x-api-key
    bearer = anthropic.Anthropic(base_url=server.root_url, auth_token=session.key, max_retries=0, timeout=60)
    assert bearer.messages.create(model="m", max_tokens=64, messages=USER).content[0].text == "Answer: 3"
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.root_url, api_key="nobody", max_retries=0).messages.create(
            model="m", max_tokens=8, messages=USER)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"


def test_messages_refusals_have_anthropic_error_bodies(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, "Answer: 3"))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=8, messages=USER, extra_body={"top_k": 5})
    assert err.value.body["error"] == {"type": "invalid_request_error", "message": err.value.body["error"]["message"]}
    assert "top_k" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\] is a tool_result for "
                                                      "tool_use_id 'toolu_none'"):
        client.messages.create(model="m", max_tokens=8, messages=[
            *USER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none", "content": "3"}]}])
    headers = {"x-api-key": session.key, "anthropic-version": "2023-06-01"}
    missing = httpx.post(f"{server.root_url}/v1/messages", json={"model": "m", "messages": USER}, headers=headers)
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in missing.json()["error"]["message"]
    big = httpx.post(f"{server.root_url}/v1/messages", content=b"x" * (server.max_request_bytes + 1), headers=headers)
    assert big.status_code == 413 and big.json() == {"type": "error", "error": {
        "type": "request_too_large", "message": big.json()["error"]["message"]}}
    unknown = httpx.post(f"{server.root_url}/v1/messages/batches", json={}, headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert [m.id for m in client.models.list().data] == ["policy"]  # x-api-key works on /v1/models too
    assert engine.prompts == []


# -- tool_choice, parallel calls, closed streams (the chat path's rules, through each API) --------------

CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
NAMED = '<tool_call>\n{"name": "add", "arguments": '


def _forced_call(tok, session, engine):
    forced_ids = tok(NAMED, add_special_tokens=False)["input_ids"]
    assert engine.prompts[-1][-len(forced_ids):] == forced_ids  # the call opening was forced
    rec = session.trained()
    assert rec.loss_mask[rec.turns[0].start - len(forced_ids):rec.turns[0].start] == [0] * len(forced_ids)


def test_responses_named_tool_choice_and_parallel_calls(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, CALL_TEXT[len(NAMED):]))
    session, client = open_session(server, engine, tok)
    out = client.responses.create(model="m", input=USER, tools=RESPONSES_TOOLS,
                                  tool_choice={"type": "function", "name": "add"})
    assert [(i.type, i.name, json.loads(i.arguments)) for i in out.output] == [("function_call", "add", {"a": 1, "b": 2})]
    _forced_call(tok, session, engine)
    engine2 = ScriptedEngine(_odd_ids(tok, CALL_TEXT + "\n" + CALL_TEXT))
    _, client2 = open_session(server, engine2, tok, max_new_tokens=128)
    one = client2.responses.create(model="m", input=USER, tools=RESPONSES_TOOLS, parallel_tool_calls=False)
    two = client2.responses.create(model="m", input="Compute 2 + 2.", tools=RESPONSES_TOOLS)
    assert [i.type for i in one.output] == ["function_call"] and [i.type for i in two.output] == ["function_call"] * 2


def test_messages_tool_choice_tool_any_none_and_parallel_calls(server, tok):
    engine = ScriptedEngine(lambda prompt: _odd_ids(tok, CALL_TEXT[len(NAMED):]))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    out = client.messages.create(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "add"})
    assert out.stop_reason == "tool_use" and [(b.name, b.input) for b in out.content] == [("add", {"a": 1, "b": 2})]
    _forced_call(tok, session, engine)
    engine2 = ScriptedEngine(_odd_ids(tok, CALL_TEXT + "\n" + CALL_TEXT))
    session2, _ = open_session(server, engine2, tok, max_new_tokens=128)
    client2 = _anthropic(server, session2)
    one = client2.messages.create(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in one.content] == ["tool_use"]
    none = client2.messages.create(model="m", messages=USER, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "none"}, max_tokens=128)
    assert none.stop_reason == "end_turn" and none.content[0].text == CALL_TEXT + "\n" + CALL_TEXT
    with pytest.raises(anthropic.BadRequestError, match="needs tools"):
        client2.messages.create(model="m", max_tokens=8, messages=USER, tool_choice={"type": "any"})


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_closed_stream_aborts_its_generation(server, tok, api):
    engine = ScriptedEngine(_odd_ids(tok, *(["word "] * 200)), delay_s=0.02)
    session, client = open_session(server, engine, tok, max_new_tokens=200)
    if api == "responses":
        stream = client.responses.create(model="m", input=USER, stream=True)
        kinds = [next(iter(stream)).type for _ in range(5)]
        assert kinds[-1] == "response.output_text.delta"
    else:
        stream = _anthropic(server, session).messages.create(model="m", max_tokens=200, messages=USER, stream=True)
        kinds = [next(iter(stream)).type for _ in range(3)]
        assert kinds[-1] == "content_block_delta"
    stream.close()
    deadline = time.monotonic() + 10
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cancelled == 1 and session.stats.aborted == 1 and session.replies == []


def test_streamed_text_then_a_call_are_two_output_items_sent_back_as_one_turn(server, tok):
    call = _odd_ids(tok, "Let me add.\n", CALL_TEXT)
    answer = _odd_ids(tok, "Answer: 3")
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer, delay_s=0.001)
    session, client = open_session(server, engine, tok, max_new_tokens=128)
    with client.responses.stream(model="m", input=USER, tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        first = stream.get_final_response()
    assert [i.type for i in first.output] == ["message", "function_call"]
    assert first.output_text == "Let me add."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me add."
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call")]
    fc = first.output[1]
    second = client.responses.create(model="m", tools=RESPONSES_TOOLS, input=[
        *USER, *first.output, {"type": "function_call_output", "call_id": fc.call_id, "output": "3"}])
    assert second.output_text == "Answer: 3"
    assert [list(t.token_ids) for t in session.trained().turns] == [call, answer]
    assert session.stats.branches == 0 and session.metrics()["agent/chain_replies"] == 2.0


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "m", "input": USER}),
    ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER}),
])
def test_an_sdk_retry_gets_the_recorded_answer(server, tok, path, body):
    engine = ScriptedEngine(_odd_ids(tok, "Answer: 3"))
    session, _ = open_session(server, engine, tok)
    headers = {"Authorization": f"Bearer {session.key}"}
    first = httpx.post(f"{server.root_url}{path}", json=body, headers=headers, timeout=30)
    again = httpx.post(f"{server.root_url}{path}", json=body, headers={**headers, "x-stainless-retry-count": "1"},
                       timeout=30)
    assert first.status_code == again.status_code == 200
    text = (lambda r: r.json()["output"][0]["content"][0]["text"]) if path == "/v1/responses" \
        else (lambda r: r.json()["content"][0]["text"])
    assert text(first) == text(again) == "Answer: 3"
    assert len(engine.prompts) == 1 and session.stats.replayed == 1 and len(session.replies) == 1


def test_responses_stream_of_a_cut_reply_and_of_an_empty_one(server, tok):
    engine = ScriptedEngine(lambda prompt: [2] if len(engine.prompts) == 2 else _odd_ids(tok, "Ans", "wer: ", "3"))
    session, client = open_session(server, engine, tok)
    cut = list(client.responses.create(model="m", input=USER, max_output_tokens=2, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in cut if e.type == "response.output_text.delta") == cut[-1].response.output_text
    empty = list(client.responses.create(model="m", input="Say nothing.", stream=True))
    assert empty[-1].type == "response.completed" and empty[-1].response.output_text == ""
    assert [i.type for i in empty[-1].response.output] == ["message"]
    assert [e.type for e in empty if e.type.startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"]
