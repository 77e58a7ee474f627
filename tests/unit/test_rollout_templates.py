"""Chat templates that render the assistant -> tool boundary their own way: token-in/token-out copes
(the trajectory is exactly what the template renders), or the renderer refuses the template at
start-up with a ConfigError naming the feature. Real jinja templates, the SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from transformers import AutoTokenizer

from relax_agent.envs import TextEnv
from relax_agent.errors import ConfigError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser

CALL = '<tool_call>{"name": "echo", "arguments": {"x": 7}}</tool_call>'

LLAMA31_EOM = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' }}"
    "{{- message.content | trim }}"
    "{%- if message.role == 'assistant' and not loop.last and messages[loop.index0 + 1].role == 'tool' %}"
    "{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama-3.1's shape: an assistant turn that a tool result follows ends with <|eom_id|>, others with <|eot_id|>."""

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
"""Gemma-2's template, verbatim: no system role, strict user/model alternation (so no tool role)."""

NEEDS_TOOL_CALLS = (
    "{%- set ns = namespace(calls=false) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' and not ns.calls %}"
    "{{- raise_exception('a tool message must follow an assistant message with tool_calls') }}{%- endif %}"
    "{%- if message.role == 'assistant' %}{%- set ns.calls = message.tool_calls is defined and message.tool_calls %}"
    "{%- elif message.role != 'tool' %}{%- set ns.calls = false %}{%- endif %}"
    "{%- if message.role == 'tool' %}{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, but a tool message is an error unless the assistant turn before it has ``tool_calls``."""


@pytest.fixture
def make_tokenizer(tiny_model_dir):
    def make(template, special=()):
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        tok.add_tokens(list(special), special_tokens=True)
        tok.chat_template = template
        return tok
    return make


class ScriptedEngine:
    """Replies the given (text, closing token) pairs in order, log-prob -0.5 per token."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.policy_version, self.prompts = tokenizer, list(replies), 0, []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        text, end = self.replies.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids(end)]
        return Generation(tuple(ids), (-0.5,) * len(ids), "stop", 0)


class EchoEnv(TextEnv):
    """The first turn calls echo (tool result "echo: 7"), the second answers."""

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        tools = [{"type": "function", "function": {"name": "echo", "description": "Echo x.",
                  "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
        return [{"role": "user", "content": "Call echo with x=7."}], {"tools": tools}

    def step(self, action):
        if action["tool_calls"]:
            return [{"role": "tool", "content": "echo: 7"}], 0.0, False, False, {}
        return [], 1.0, True, False, {}


def play(tok, replies, renderer=None):
    renderer = renderer or ChatRenderer(tok, tools_in="system")
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=3, max_total_tokens=4096)
    traj = asyncio.run(run_episode(EchoEnv(), spec, ScriptedEngine(tok, replies), renderer, HermesParser(),
                                   SamplingParams(64)))
    return traj, renderer


def test_llama31_eom_after_a_tool_call_turn_is_kept_and_the_delta_follows_it(make_tokenizer):
    tok = make_tokenizer(LLAMA31_EOM, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"])
    traj, renderer = play(tok, [(CALL, "<|eom_id|>"), ("done", "<|eot_id|>")])
    assert traj.error is None and traj.reward == 1.0 and traj.stop_reason == "terminated"
    convo = list(renderer.render_prompt([{"role": "user", "content": "Call echo with x=7."}],
                                        EchoEnv()._reset_task({})[1]["tools"]).messages)
    convo += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "echo: 7"},
              {"role": "assistant", "content": "done"}]
    assert tok.decode(traj.token_ids) == tok.apply_chat_template(convo, tokenize=False)
    first = traj.turns[0]
    after = traj.token_ids[first.start + len(first.token_ids):traj.turns[1].start]
    assert tok.decode(after) == "<|start_header_id|>ipython<|end_header_id|>\n\necho: 7<|eot_id|>" \
                                "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_llama31_length_cut_turn_is_closed_with_the_eom_the_template_puts_before_a_tool(make_tokenizer):
    tok = make_tokenizer(LLAMA31_EOM, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"])
    renderer = ChatRenderer(tok)
    delta = renderer.observation_delta([{"role": "tool", "content": "r"}], closed=False)
    assert tok.decode(delta) == "<|eom_id|><|start_header_id|>ipython<|end_header_id|>\n\nr<|eot_id|>" \
                                "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert tok.decode(renderer.observation_delta([{"role": "user", "content": "u"}], closed=False)).startswith("<|eot_id|>")


def test_gemma2_without_system_or_tool_roles_runs_with_system_folded_and_tools_as_user(make_tokenizer):
    tok = make_tokenizer(GEMMA2, ["<start_of_turn>", "<end_of_turn>"])
    renderer = ChatRenderer(tok, tools_in="system")
    assert not renderer.system_role and renderer.tool_role == "user"
    traj, _ = play(tok, [(CALL, "<end_of_turn>"), ("done", "<end_of_turn>")], renderer)
    assert traj.error is None and traj.reward == 1.0
    prompt = renderer.render_prompt([{"role": "user", "content": "Call echo with x=7."}], EchoEnv()._reset_task({})[1]["tools"])
    folded = renderer._fold_system(list(prompt.messages))
    assert folded[0]["role"] == "user" and folded[0]["content"].startswith("You are a function-calling AI model")
    convo = folded + [{"role": "assistant", "content": CALL},
                      {"role": "user", "content": "<tool_response>\necho: 7\n</tool_response>"},
                      {"role": "assistant", "content": "done"}]
    assert tok.decode(traj.token_ids) == tok.apply_chat_template(convo, tokenize=False).rstrip("\n")


def test_a_template_that_needs_tool_calls_keeps_its_own_tool_format(make_tokenizer):
    tok = make_tokenizer(NEEDS_TOOL_CALLS)
    renderer = ChatRenderer(tok, tools_in="system")
    traj, _ = play(tok, [(CALL, "<|im_end|>"), ("done", "<|im_end|>")], renderer)
    assert traj.error is None and traj.reward == 1.0
    first = traj.turns[0]
    after = traj.token_ids[first.start + len(first.token_ids):traj.turns[1].start]
    # the template's tool message, not a user message standing in for it
    assert tok.decode(after) == "\n<|im_start|>tool\n<tool_response>\necho: 7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert renderer.tool_role == "tool"


@pytest.mark.parametrize("template, feature", [
    ("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
     "closes an assistant turn with no special token"),
    ("{% for m in messages %}{{ '<|im_start|>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + m.content + '<|im_end|>\\n' }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
     "generation prompt"),
    ("{% if messages | length > 2 %}{{ raise_exception('single exchange only') }}{% endif %}"
     "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
     "cannot render a user message after an assistant turn"),
    ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
     "{{ m.content | upper if m.role == 'assistant' and not loop.last else m.content }}{{ '<|im_end|>\\n' }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
     "renders an assistant turn differently"),
])
def test_templates_that_cannot_be_used_are_refused_at_start_up_naming_the_feature(make_tokenizer, template, feature):
    with pytest.raises(ConfigError, match="model.path: the chat template") as err:
        ChatRenderer(make_tokenizer(template))
    assert feature in str(err.value)


def test_the_smollm2_template_deltas_are_unchanged(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = ChatRenderer(tok)
    assert renderer.system_role and renderer.tool_role == "tool" and renderer.end_of_turn_ids == (2,)
    for msgs in ([{"role": "tool", "content": "echo: 7"}], [{"role": "user", "content": " again "}], []):
        reference = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        full = tok.apply_chat_template(reference + msgs, tokenize=False, add_generation_prompt=True)
        tail = full[len(tok.apply_chat_template(reference, tokenize=False).rstrip("\n")):]
        assert renderer.observation_delta(msgs) == tok(tail, add_special_tokens=False)["input_ids"]


QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Added (non-special) tokens of the Qwen3 tokenizer; ``<|im_start|>``/``<|im_end|>`` are SmolLM2's own."""
THINK_CALL = '<think>\nI should call echo.\n</think>\n\n<tool_call>\n{"name": "echo", "arguments": {"x": 7}}\n</tool_call>'


def qwen3_tokenizer(tiny_model_dir):
    """The SmolLM2 tokenizer with Qwen3's real chat template and its added tokens."""
    from pathlib import Path

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(QWEN3_TOKENS)
    tok.chat_template = (Path(__file__).parents[1] / "data/chat_templates/Qwen-Qwen3-0.6B.jinja").read_text()
    return tok


class FollowUpEnv(EchoEnv):
    """The first turn calls echo, then a user follow-up (a new query), then the answer ends it."""

    def _reset_task(self, task):
        self.turn = 0
        return super()._reset_task(task)

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "tool", "content": "echo: 7"}], 0.0, False, False, {}
        if self.turn == 2:
            return [{"role": "user", "content": "And x=8?"}], 0.0, False, False, {}
        return [], 1.0, True, False, {}


def test_qwen3_template_that_drops_past_reasoning_is_accepted_and_sampled_turns_are_kept(tiny_model_dir):
    """Qwen3's real template renders <think> only for assistant turns after the last user query, so it is
    not append-only; the renderer aligns deltas from the content on and every trained token is a sampled one."""
    tok = qwen3_tokenizer(tiny_model_dir)
    renderer = ChatRenderer(tok)
    assert renderer.append_only is False and renderer.use_template_tools and renderer.end_of_turn_ids == (2,)
    replies = [(THINK_CALL, "<|im_end|>"), ("<think>\nThe tool said 7.\n</think>\n\nIt is 7.", "<|im_end|>"),
               ("<think>\nx=8 now.\n</think>\n\nIt is 8.", "<|im_end|>")]
    engine = ScriptedEngine(tok, list(replies))
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=4, max_total_tokens=4096)
    traj = asyncio.run(run_episode(FollowUpEnv(), spec, engine, renderer, HermesParser(), SamplingParams(64)))
    assert traj.error is None and traj.reward == 1.0 and len(traj.turns) == 3
    for turn, (text, end) in zip(traj.turns, replies, strict=True):  # sampled ids kept verbatim, reasoning included
        sampled = tuple(tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(end)])
        assert turn.token_ids == sampled == tuple(traj.token_ids[turn.start:turn.start + len(sampled)])
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert trained == [t for turn in traj.turns for t in turn.token_ids]
    between = [tok.decode(traj.token_ids[a.start + len(a.token_ids):b.start]) for a, b in itertools.pairwise(traj.turns)]
    assert between == ["\n<|im_start|>user\n<tool_response>\necho: 7\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                       "\n<|im_start|>user\nAnd x=8?<|im_end|>\n<|im_start|>assistant\n"]
    # re-rendering the history would have dropped the first turns' reasoning: the trajectory is not that
    prompt = tok.decode(traj.token_ids[:traj.prompt_len])
    assert prompt.endswith("<|im_start|>user\nCall echo with x=7.<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>\nI should call echo.\n</think>" in tok.decode(traj.token_ids)
    history = [{"role": "user", "content": "Call echo with x=7."}, {"role": "assistant", "content": THINK_CALL},
               {"role": "tool", "content": "echo: 7"}, {"role": "assistant", "content": replies[1][0]},
               {"role": "user", "content": "And x=8?"}]
    rerendered = tok.apply_chat_template(history, tools=EchoEnv()._reset_task({})[1]["tools"], tokenize=False)
    assert "I should call echo." not in rerendered


def test_qwen3_length_cut_turn_delta_starts_with_the_closing_token(tiny_model_dir):
    tok = qwen3_tokenizer(tiny_model_dir)
    renderer = ChatRenderer(tok)
    delta = renderer.observation_delta([{"role": "tool", "content": "r"}], closed=False)
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n" \
                                "<|im_start|>assistant\n"
