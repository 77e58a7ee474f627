"""What agent frameworks send the endpoint without asking (through the official ``openai`` and
``anthropic`` SDKs on 127.0.0.1, a scripted engine): documented no-op hints accepted, Anthropic's
``count_tokens``, prefill and partial ``tool_result`` refusal, the ``thread`` fallback of the SDK's
tool runner, ``Idempotency-Key`` reuse, and a hung-up non-streamed request aborted."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from relax_agent.config import ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.proxy.server import EndpointServer
from tests.unit.test_endpoint_apis import ANTHROPIC_TOOLS, CALL_TEXT, USER
from tests.unit.test_endpoint_openai import TOOLS, ScriptedEngine, open_session


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def server():
    srv = EndpointServer(hangup_grace_s=0.3).start()
    yield srv
    srv.close()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [2]


def _anthropic(server, session):
    return anthropic.Anthropic(base_url=server.root_url, api_key=session.key, max_retries=0, timeout=60)


# -- documented no-op hints -------------------------------------------------------------------------


def test_documented_hints_are_accepted_and_change_nothing(server, tok):
    engine = ScriptedEngine(_ids(tok, "Answer: 3"))
    session, client = open_session(server, engine, tok)
    hints = {"prompt_cache_key": "agent-7", "prompt_cache_retention": "24h", "safety_identifier": "u-1",
             "service_tier": "flex", "metadata": {"run": "x"}, "user": "u-1", "store": True}
    plain = client.chat.completions.create(model="m", messages=USER)
    hinted = client.chat.completions.create(model="m", messages=USER, **hints)
    assert hinted.choices[0].message.content == plain.choices[0].message.content == "Answer: 3"
    out = client.responses.create(model="m", input=USER, **hints, stream_options={"include_obfuscation": False})
    assert out.output_text == "Answer: 3"
    reply = _anthropic(server, session).messages.create(
        model="m", max_tokens=16, messages=USER, metadata={"user_id": "u-1"}, service_tier="standard_only",
        cache_control={"type": "ephemeral"}, inference_geo="us", speed="fast",
        extra_body={"user_profile_id": "p-1", "workspace_id": "w-1"})
    assert reply.content[0].text == "Answer: 3"
    assert len({tuple(p) for p in engine.prompts}) == 1 and len(engine.prompts) == 4  # the same prompt each time
    assert all(k != session.key for k, _ in server.refused)
    with pytest.raises(openai.BadRequestError) as err:  # a field that would change the reply is still refused
        client.chat.completions.create(model="m", messages=USER, reasoning_effort="high")
    assert err.value.body["param"] == "reasoning_effort"


# -- Anthropic: count_tokens, prefill, partial tool results, the tool runner ---------------------------------


def test_count_tokens_is_the_prompt_the_messages_route_samples_from(server, tok):
    engine = ScriptedEngine(lambda prompt: _ids(tok, CALL_TEXT) if len(engine.prompts) == 1 else _ids(tok, "Answer: 3"))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    first_body = {"model": "m", "messages": USER, "system": "Be brief.", "tools": ANTHROPIC_TOOLS}
    counted = client.messages.count_tokens(**first_body)
    assert engine.prompts == [] and session.replies == []  # counting samples and records nothing
    first = client.messages.create(max_tokens=64, **first_body)
    prompt = ChatRenderer(tok).render_prompt([{"role": "system", "content": "Be brief."}, *USER], TOOLS).token_ids
    assert counted.input_tokens == first.usage.input_tokens == len(engine.prompts[0]) == len(prompt)
    use = first.content[0]
    second_body = {**first_body, "messages": [*USER, {"role": "assistant", "content": first.content}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]}
    counted = client.messages.count_tokens(**second_body)  # the recorded tokens plus the tool result's delta
    second = client.messages.create(max_tokens=64, **second_body)
    assert counted.input_tokens == second.usage.input_tokens == len(engine.prompts[1])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is not supported"):
        client.messages.count_tokens(model="m", messages=USER, extra_body={"max_tokens": 5})


def test_a_final_assistant_turn_is_a_prefill_the_reply_continues(server, tok):
    engine = ScriptedEngine(_ids(tok, " 3, since 1 + 2 = 3."))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    prefilled = [*USER, {"role": "assistant", "content": "Answer:"}]
    reply = client.messages.create(model="m", max_tokens=64, messages=prefilled)
    assert [b.text for b in reply.content] == [" 3, since 1 + 2 = 3."]  # only the new text, as Anthropic returns it
    prefill_ids = tok("Answer:", add_special_tokens=False)["input_ids"]
    prompt = list(ChatRenderer(tok).render_prompt(USER).token_ids)
    assert engine.prompts[0] == prompt + prefill_ids  # the policy continues the prefill, not a new turn
    rec = session.trained()
    assert rec.token_ids[:len(prompt) + len(prefill_ids)] == prompt + prefill_ids
    assert rec.loss_mask[len(prompt):len(prompt) + len(prefill_ids)] == [0] * len(prefill_ids)
    assert rec.messages[-1]["content"] == "Answer: 3, since 1 + 2 = 3."  # the recorded turn is the whole answer
    with client.messages.stream(model="m", max_tokens=64, messages=prefilled) as stream:
        assert "".join(stream.text_stream) == " 3, since 1 + 2 = 3."
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="m", max_tokens=8, messages=[*USER, {"role": "assistant", "content": "Answer: "}])


def test_tool_use_ids_left_without_a_tool_result_are_refused_as_anthropic_refuses_them(server, tok):
    engine = ScriptedEngine(_ids(tok, "Answer: 3"))
    session, _ = open_session(server, engine, tok)
    client = _anthropic(server, session)
    calls = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 1, "b": 2}},
        {"type": "tool_use", "id": "toolu_b", "name": "add", "input": {"a": 3, "b": 4}}]}
    one_result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "3"}]}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=[*USER, calls, one_result])
    assert err.value.body["error"] == {"type": "invalid_request_error", "message": (
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_b. Each "
        "`tool_use` block must have a corresponding `tool_result` block in the next message.")}
    with pytest.raises(anthropic.BadRequestError, match="toolu_a, toolu_b"):
        client.messages.create(model="m", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=[*USER, calls])
    both = {"role": "user", "content": [*one_result["content"],
                                        {"type": "tool_result", "tool_use_id": "toolu_b", "content": "7"}]}
    ok = client.messages.create(model="m", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=[*USER, calls, both])
    assert ok.content[0].text == "Answer: 3" and len(engine.prompts) == 1


def test_the_anthropic_tool_runner_falls_back_from_threads_and_trains_one_chain(server, tok):
    call, answer = _ids(tok, CALL_TEXT), _ids(tok, "Answer: 3")
    engine = ScriptedEngine(lambda prompt: call if len(engine.prompts) == 1 else answer)
    session, _ = open_session(server, engine, tok)

    @anthropic.beta_tool
    def add(a: float, b: float) -> str:
        """Add two numbers."""
        return str(a + b)

    runner = _anthropic(server, session).beta.messages.tool_runner(model="m", max_tokens=64, tools=[add],
                                                                   messages=USER)
    messages = list(runner)
    assert [b.type for b in messages[0].content] == ["tool_use"] and messages[-1].content[0].text == "Answer: 3"
    assert [list(t.token_ids) for t in session.trained().turns] == [call, answer]
    assert session.stats.branches == 0 and len(engine.prompts) == 2
    assert all(k != session.key for k, _ in server.refused)  # the fallback is not counted as a refusal
    threaded = httpx.post(f"{server.root_url}/v1/messages", headers={"x-api-key": session.key}, timeout=30, json={
        "model": "m", "max_tokens": 8, "messages": USER, "thread": {"type": "create"}})
    assert threaded.status_code == 400
    assert threaded.json()["error"]["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}


# -- Idempotency-Key, hang-ups -------------------------------------------------------------------------


def test_an_idempotency_key_reused_with_another_body_is_refused_with_422(server, tok):
    engine = ScriptedEngine(_ids(tok, "Answer: 3"))
    session, _ = open_session(server, engine, tok)
    url, auth = f"{server.base_url}/chat/completions", {"Authorization": f"Bearer {session.key}"}
    body = {"model": "m", "messages": USER}
    first = httpx.post(url, json=body, headers={**auth, "Idempotency-Key": "k1"}, timeout=30)
    again = httpx.post(url, json=body, headers={**auth, "Idempotency-Key": "k1"}, timeout=30)
    assert first.status_code == again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "Compute 2 + 2."}]},
                       headers={**auth, "Idempotency-Key": "k1"}, timeout=30)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert "'k1' was first used with a different request body" in other.json()["error"]["message"]
    assert len(engine.prompts) == 1  # neither replayed as the first answer nor sampled
    refused = httpx.post(url, json={**body, "made_up": 1}, headers={**auth, "Idempotency-Key": "k2"}, timeout=30)
    fixed = httpx.post(url, json=body, headers={**auth, "Idempotency-Key": "k2"}, timeout=30)
    assert refused.status_code == 400 and fixed.status_code == 200  # a refused request does not keep its key
    messages = httpx.post(f"{server.root_url}/v1/messages", timeout=30,
                          json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi."}]},
                          headers={"x-api-key": session.key, "Idempotency-Key": "k1"})
    assert messages.status_code == 422 and messages.json()["error"]["type"] == "invalid_request_error"


class CountingEngine(ScriptedEngine):
    """Counts the tokens it has sampled."""

    def __init__(self, replies, delay_s):
        super().__init__(replies, delay_s)
        self.sampled = 0

    async def generate(self, prompt_ids, params, on_token=None):
        def count(t, lp, v):
            self.sampled += 1
            if on_token is not None:
                on_token(t, lp, v)
        return await super().generate(prompt_ids, params, on_token=count)


def test_a_non_streamed_request_whose_client_hung_up_stops_sampling(server, tok):
    engine = CountingEngine(_ids(tok, "word " * 200), delay_s=0.05)  # ~10 s to sample in full
    session, _ = open_session(server, engine, tok, max_new_tokens=256)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json={"model": "m", "messages": USER},
                   headers={"Authorization": f"Bearer {session.key}"}, timeout=1.0)
    at_hang_up = engine.sampled
    deadline = time.monotonic() + 30
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cancelled == 1 and session.stats.aborted == 1 and session.replies == []
    stopped_at = engine.sampled
    time.sleep(0.5)
    assert at_hang_up <= stopped_at == engine.sampled < 200  # it stopped, well before the reply's end


# -- length-cut replies through the SDKs' stream helpers (what the agents guide documents) -----------------


def test_each_sdks_stream_helper_on_a_length_cut_reply(server, tok):
    engine = ScriptedEngine(_ids(tok, "word " * 30))
    session, client = open_session(server, engine, tok)
    with client.chat.completions.stream(model="m", messages=USER, max_tokens=3) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        with pytest.raises(openai.LengthFinishReasonError) as err:  # as against OpenAI: the final parse raises
            stream.get_final_completion()
    assert chunks[-1].choices[0].finish_reason == "length"
    assert err.value.completion.choices[0].message.content == "word word word"
    with client.responses.stream(model="m", input=USER, max_output_tokens=3) as stream:
        events = list(stream)
        with pytest.raises(RuntimeError, match="response.completed"):  # the helper waits for a completed response
            stream.get_final_response()
    cut = events[-1]
    assert cut.type == "response.incomplete" and cut.response.incomplete_details.reason == "max_output_tokens"
    assert cut.response.output_text == "word word word" and cut.response.output[0].status == "incomplete"
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    plain = client.responses.create(model="m", input=USER, max_output_tokens=3)
    assert plain.status == "incomplete" and plain.output[0].status == "incomplete"
    with _anthropic(server, session).messages.stream(model="m", max_tokens=3, messages=USER) as stream:
        final = stream.get_final_message()  # the anthropic helper does not raise
    assert final.stop_reason == "max_tokens" and final.content[0].text == "word word word"
