"""The agent endpoint with every policy family's real chat template and tool-call parser: a reply in
the family's own call format comes back to the agent as OpenAI ``tool_calls`` (special-token call
markers included: the reply is decoded for the run's parser as the env driver decodes it), the
reply's content is the parser's (reasoning split off), a streamed answer joins to the same content,
and the episode's record is the sampled ids with the template's delta between them, nothing
re-tokenized. Fake engine, family tokenizers as in ``test_family_templates``."""

from __future__ import annotations

import asyncio
import itertools
import json

import openai
import pytest
from transformers import AutoTokenizer

from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import build_parser
from relax_agent.rollout.proxy.server import EndpointServer
from relax_agent.rollout.proxy.session import AgentSession
from tests.unit.test_family_templates import EPISODES, FAMILIES, TEMPLATES, TOOLS

USER = [{"role": "user", "content": "Weather in Paris?"}]
_keys = itertools.count()


@pytest.fixture(scope="module")
def server():
    srv = EndpointServer().start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def family_tok(tiny_model_dir):
    def make(family):
        name, special, plain, roles, _, _ = FAMILIES[family]
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        tok.add_tokens(special, special_tokens=True)
        tok.add_tokens(plain)
        if roles:
            tok.add_special_tokens(roles)
        tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        return tok
    return make


class _Engine:
    """Replies the scripted token ids in order (finish "stop"), streaming each through ``on_token``."""

    def __init__(self, replies):
        self.replies, self.prompts, self.policy_version = list(replies), [], 0

    async def generate(self, prompt_ids, params, on_token=None):
        self.prompts.append(list(prompt_ids))
        ids = self.replies.pop(0)
        for t in ids:
            await asyncio.sleep(0)
            if on_token is not None:
                on_token(t, -0.25, 0)
        return Generation(tuple(ids), (-0.25,) * len(ids), "stop", 0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_endpoint_returns_the_family_calls_and_records_the_sampled_ids(server, family_tok, family):
    tok = family_tok(family)
    call_turn, answer_turn, delta_text = EPISODES[family]
    sampled = [tok(t, add_special_tokens=False)["input_ids"] for t in (call_turn, answer_turn)]
    engine = _Engine(sampled)
    key = f"family-key-{next(_keys)}"
    renderer, parser = ChatRenderer(tok), build_parser(family)
    session = AgentSession(EpisodeSpec(f"s{key}", "g", "t", {}, seed=1, max_total_tokens=4096), key, engine, renderer,
                           parser, SamplingParams(max_new_tokens=256))
    server.open(session)
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)

    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0]
    assert first.finish_reason == "tool_calls" and not first.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    messages = [*USER, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "sunny"}]
    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Sunny."
    assert chunks[-1].finish_reason == "stop" and not any(c.delta.tool_calls for c in chunks)

    rec = session.primary.rec
    prompt = list(renderer.render_prompt(USER, TOOLS).token_ids)
    delta = rec.token_ids[len(prompt) + len(sampled[0]):rec.turns[1].start]
    call_id = first.message.tool_calls[0].id  # Kimi K2's template writes it in the result
    assert tok.decode(delta) == delta_text.replace("call_0", call_id)  # the template's own text for the tool result
    assert rec.token_ids == prompt + sampled[0] + delta + sampled[1]
    assert [list(t.token_ids) for t in rec.turns] == sampled
    assert engine.prompts[1] == prompt + sampled[0] + delta  # the sampled ids, never re-rendered
    assert rec.loss_mask == [0] * len(prompt) + [1] * len(sampled[0]) + [0] * len(delta) + [1] * len(sampled[1])
    assert session.stats.tool_parse_failures == 0 and session.stats.branches == 0
