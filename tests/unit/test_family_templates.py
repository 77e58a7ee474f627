"""Each policy family's real chat template (``tests/data/chat_templates/``, see its README) against
its tool-call parser: the template renders a tool-call turn, the model-side text is tokenized and
decoded the way the rollout driver does it, and the family parser reads the same calls back (round
trip); malformed variants are parse errors returned as data; reasoning is kept out of the content;
``tool_parser: auto`` names the family; the chat renderer accepts the template (or refuses it
naming the feature).

Tokenizer: no family's own tokenizer is reached (tests run offline). Each test uses the SmolLM2
tokenizer of the ``tiny_model_dir`` fixture with the family's special tokens added (as special
tokens where the family marks them special, as plain added tokens otherwise) and its BOS/EOS set,
and the family's real template as ``chat_template``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from relax_agent.envs import TextEnv
from relax_agent.errors import ConfigError
from relax_agent.replay import check_deltas
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams, default_stop_ids
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import build_parser, decodes_special_tokens
from relax_agent.rollout.tool_parsers import resolve_tool_parser
from relax_agent.train.algorithms import RATIO_MEAN
from relax_agent.train.reference_grpo import sequence_logprobs

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"

FAMILIES = {
    # family: (template file, special tokens, plain added tokens, bos/eos, text before the model's turn, turn end)
    "qwen3": ("Qwen-Qwen3-0.6B", [], ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                      "</tool_response>"], {}, "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3_coder": ("Qwen3-Coder", [], ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], {},
                    "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("meta-llama-Llama-3.3-70B-Instruct", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                                     "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], [],
               {"bos_token": "<|begin_of_text|>"}, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407", ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                                         "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                         "[/TOOL_RESULTS]"], [],
                {"bos_token": "<s>", "eos_token": "</s>"}, "[/INST]", "</s>"),
    "gpt_oss": ("openai-gpt-oss-120b", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                        "<|return|>", "<|call|>"], [], {}, "<|start|>assistant", "<|call|>"),
    "deepseek_v3": ("deepseek-ai-DeepSeek-V3.1", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                                  "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                                                  "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
                    ["<think>", "</think>"],
                    {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
                    "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "glm45": ("GLM-4.6", ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                          "<|endoftext|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                          "</arg_value>", "<tool_response>", "</tool_response>", "<think>", "</think>"], [],
              {"eos_token": "<|endoftext|>"}, "<|assistant|>", "<|observation|>"),
    "kimi_k2": ("moonshotai-Kimi-K2", ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                                       "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                       "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"], [],
                {}, "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "gemma": ("google-gemma-4-31B-it", ["<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>",
                                        "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", '<|"|>',
                                        "<|channel>", "<channel|>", "<|think|>"], [],
              {"bos_token": "<bos>"}, "<|turn>model\n", "<|tool_response>"),
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALLS = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
         {"name": "get_time", "arguments": {"tz": "UTC", "utc": True}}]
SINGLE_CALL = {"llama3", "gpt_oss"}
"""Families whose template renders one call per assistant turn (Llama 3 refuses more; gpt-oss renders the first)."""


@pytest.fixture(scope="module")
def family_tokenizer(tiny_model_dir):
    cache = {}

    def make(family):
        if family not in cache:
            name, special, plain, roles, _, _ = FAMILIES[family]
            tok = AutoTokenizer.from_pretrained(tiny_model_dir)
            tok.add_tokens(special, special_tokens=True)
            tok.add_tokens(plain)
            if roles:
                tok.add_special_tokens(roles)
            tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
            cache[family] = tok
        return cache[family]
    return make


def _calls(family):
    return CALLS[:1] if family in SINGLE_CALL else CALLS


def _model_side(tok, family, calls, content=""):
    """The text the template puts in the assistant turn that makes ``calls`` (after the turn's header)."""
    head = FAMILIES[family][4]
    tool_calls = [{"id": f"abcDEF12{i}", "type": "function", "function": c} for i, c in enumerate(calls)]
    msgs = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    full = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    return full[full.rfind(head) + len(head):]


def _as_sampled(tok, parser, text):
    """``text`` tokenized, then decoded as the rollout driver decodes a sampled turn for ``parser``."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids, skip_special_tokens=not decodes_special_tokens(parser))


def _plain(action):
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in action.tool_calls]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_real_template_round_trips_through_the_family_parser(family_tokenizer, family):
    tok, parser, calls = family_tokenizer(family), build_parser(family), _calls(family)
    side = _model_side(tok, family, calls)
    action = parser.parse(_as_sampled(tok, parser, side))
    assert _plain(action) == calls and action.errors == () and action.content == ""
    assert [c["id"] for c in action.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    # the parser writes calls the way the template does (Mistral's template adds the call ids)
    if family != "mistral":
        assert parser.format(calls) in side
    assert _plain(parser.parse(_as_sampled(tok, parser, parser.format(CALLS if family != "llama3" else calls)))) == \
        (CALLS if family != "llama3" else calls)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_names_the_family_from_its_template(family_tokenizer, family):
    name, why = resolve_tool_parser(family_tokenizer(family), model_name="some/model")
    if family == "deepseek_v3":  # its template never reads `tools`: the Hermes system prompt introduces them
        assert (name, why) == ("hermes_strict", "the chat template renders no tools; the Hermes system prompt "
                                                "asks for <tool_call> JSON")
        return
    assert name == family and why.startswith("chat template has")


def test_auto_without_template_tools_is_hermes_and_refuses_what_it_cannot_tell(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2: the template never reads tools
    assert resolve_tool_parser(tok)[0] == "hermes_strict"
    assert resolve_tool_parser(family_free := tok, tools_in="system")[0] == "hermes_strict"
    with pytest.raises(ConfigError, match="rollout.system_prompt"):
        resolve_tool_parser(family_free, system_prompt="Call tools as XML.")
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"
    assert resolve_tool_parser(tok, model_name="Qwen/Qwen3-8B") == ("qwen3", "model name 'Qwen/Qwen3-8B' matches 'qwen3|qwq'")
    assert resolve_tool_parser(tok, model_name="openai/gpt-oss-20b")[0] == "gpt_oss"
    with pytest.raises(ConfigError, match="rollout.tool_parser=auto: cannot tell .*'acme/model-7b'.* qwen3_coder"):
        resolve_tool_parser(tok, model_name="acme/model-7b")
    with pytest.raises(ConfigError, match="resolved from the policy's chat template"):
        build_parser("auto")


MALFORMED = [
    ("qwen3", '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
     "no closing </tool_call>"),
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}}\n</tool_call>', "instead of </tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", "no closing </tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     "not one closed <function=NAME>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nParis\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     "text outside its parameters"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} Let me know!', "followed by 'Let me know!'"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Par', "not valid JSON"),
    ("llama3", '<|python_tag|>brave_search.call(query="Paris")', "not a JSON function call"),
    ("llama3", '{"name": "get_weather", "parameters": "Paris"}', "object 'parameters'"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}', "not valid JSON"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather"}]', "object 'arguments'"),
    ("mistral", "[TOOL_CALLS]get_weather Paris", "not a JSON list or NAME[ARGS]"),
    ("gpt_oss", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"', "does not end with <|call|>"),
    ("gpt_oss", ' to=python<|channel|>analysis code<|message|>print(1)<|call|>', "not a function tool"),
    ("gpt_oss", ' to=functions.get_weather<|channel|>commentary json<|message|>Paris<|call|>', "not valid JSON"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}",
     "no closing <｜tool▁call▁end｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "not NAME"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n", "no closing </tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", "text outside its arguments"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}<|tool_call_end|>"
                "<|tool_calls_section_end|>", "functions.NAME:IDX"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                "{\"city\": \"Paris\"}", "no closing <|tool_call_end|>"),
    ("gemma", '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>', "not Gemma's syntax"),
    ("gemma", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}', "no closing <tool_call|>"),
]


@pytest.mark.parametrize("family, text, error", MALFORMED)
def test_malformed_calls_are_parse_errors_returned_as_data_never_half_calls(family_tokenizer, family, text, error):
    tok, parser = family_tokenizer(family), build_parser(family)
    action = parser.parse(_as_sampled(tok, parser, text))
    assert action.tool_calls == () and len(action.errors) == 1 and error in action.errors[0]
    assert action.message()["parse_errors"] == list(action.errors) and action.message()["tool_calls"] == []


REASONING = [
    ("qwen3", '<think>\nCall <tool_call>{"name": "x", "arguments": {}}</tool_call>?\n</think>\n\nIt is sunny.<|im_end|>',
     "Call <tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>?", "It is sunny."),
    ("qwen3", "<think>\nstill thinking when the reply was cut", "still thinking when the reply was cut", ""),
    ("deepseek_v3", "I need the weather.</think>It is sunny.<｜end▁of▁sentence｜>", "I need the weather.", "It is sunny."),
    ("glm45", "\n<think>I need the weather.</think>\nIt is sunny.<|user|>", "I need the weather.", "It is sunny."),
    ("kimi_k2", "<think>I need the weather.</think>It is sunny.<|im_end|>", "I need the weather.", "It is sunny."),
    ("mistral", "[THINK]I need the weather.[/THINK]It is sunny.</s>", "I need the weather.", "It is sunny."),
    ("gpt_oss", "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is sunny.<|return|>", "I need the weather.", "It is sunny."),
    ("gemma", "<|channel>thought\nI need the weather.<channel|>It is sunny.<turn|>", "I need the weather.", "It is sunny."),
    ("llama3", "It is sunny.<|eot_id|>", "", "It is sunny."),
]


@pytest.mark.parametrize("family, text, reasoning, content", REASONING)
def test_reasoning_is_split_from_the_reply_the_env_sees(family_tokenizer, family, text, reasoning, content):
    tok, parser = family_tokenizer(family), build_parser(family)
    action = parser.parse(_as_sampled(tok, parser, text))
    assert (action.reasoning, action.content, action.tool_calls, action.errors) == (reasoning, content, (), ())
    assert action.message().get("reasoning_content", "") == reasoning


def test_reasoning_then_a_call_in_one_turn(family_tokenizer):
    tok, parser = family_tokenizer("gpt_oss"), build_parser("gpt_oss")
    text = ("<|channel|>analysis<|message|>Paris, 2 days.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')
    action = parser.parse(_as_sampled(tok, parser, text))
    assert _plain(action) == CALLS[:1] and action.reasoning == "Paris, 2 days." and action.content == ""
    tok3, qwen3 = family_tokenizer("qwen3"), build_parser("qwen3")
    side = _model_side(tok3, "qwen3", CALLS[:1], content="<think>\nParis, 2 days.\n</think>\n\nChecking.")
    action = qwen3.parse(_as_sampled(tok3, qwen3, side))
    assert _plain(action) == CALLS[:1] and action.reasoning == "Paris, 2 days." and action.content == "Checking."


RENDERER = {  # family: (append-only, closing token after a user message); every family's template is accepted
    # not append-only: Qwen3 drops past <think> blocks, gpt-oss past analysis channels, GLM past reasoning
    "qwen3": (False, "<|im_end|>"), "qwen3_coder": (True, "<|im_end|>"),
    "llama3": (True, "<|eot_id|>"), "mistral": (True, "</s>"), "gpt_oss": (False, "<|end|>"),
    "deepseek_v3": (True, "<｜end▁of▁sentence｜>"), "kimi_k2": (True, "<|im_end|>"),
    "glm45": (False, "<|user|>"),  # GLM ends a turn with the next role's token, which the policy samples
    "gemma": (True, "<turn|>"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_chat_renderer_takes_the_family_template(family_tokenizer, family):
    tok = family_tokenizer(family)
    append_only, detail = RENDERER[family]
    renderer = ChatRenderer(tok)
    assert renderer.append_only is append_only and tok.decode(renderer.end_of_turn_ids) == detail
    # tools_in: auto renders tools the way the family's template does (DeepSeek V3.1's renders none)
    assert renderer.use_template_tools is (family != "deepseek_v3")


def test_turn_end_tokens_of_the_families_stop_the_engine(family_tokenizer):
    for family, token in (("gpt_oss", "<|call|>"), ("gpt_oss", "<|return|>"), ("llama3", "<|eom_id|>")):
        tok = family_tokenizer(family)
        assert tok.convert_tokens_to_ids(token) in default_stop_ids(tok)


class _Engine:
    def __init__(self, tok, replies):
        self.tok, self.replies, self.policy_version = tok, list(replies), 0

    async def generate(self, prompt_ids, params):
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        return Generation(tuple(ids), (-0.5,) * len(ids), "stop", 0)


class _WeatherEnv(TextEnv):
    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        self.seen = []
        return [{"role": "user", "content": "Weather in Paris?"}], {"tools": TOOLS}

    def step(self, action):
        self.seen.append(action)
        if action["tool_calls"]:
            return [{"role": "tool", "tool_call_id": action["tool_calls"][0]["id"], "content": "sunny"}], 0.0, False, False, {}
        return [], 1.0, True, False, {}


EPISODES = {
    # family: (the call turn, the answer turn, each ending with the token the policy stops on; the delta the
    # template puts after the call turn for the tool result "sunny", up to the next generation prompt)
    "qwen3": ('<think>\nPlan.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": 2}}\n</tool_call><|im_end|>', "<think>\nDone.\n</think>\n\nSunny.<|im_end|>",
              "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n</function>\n</tool_call><|im_end|>", "Sunny.<|im_end|>",
                    "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}<|eot_id|>', "Sunny.<|eot_id|>",
               '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|><|start_header_id|>assistant'
               "<|end_header_id|>\n\n"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "abcDEF120"}]</s>',
                "Sunny.</s>", "[INST]<tool_response>\nsunny\n</tool_response>[/INST]"),
    "gpt_oss": ("<|channel|>analysis<|message|>Paris, 2 days.<|end|><|start|>assistant to=functions.get_weather"
                '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
                "<|channel|>final<|message|>Sunny.<|return|>",
                '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant'),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "Sunny.<｜end▁of▁sentence｜>",
                    "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"),
    "glm45": ("\n<think>Paris, 2 days.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><|observation|>",
              "\n<think></think>\nSunny.<|user|>", "\n<tool_response>\nsunny\n</tool_response><|assistant|>"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>', "Sunny.<|im_end|>",
                "<|im_system|>tool<|im_middle|>## Return of call_0\\nsunny<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    # Gemma 4: the call turn waits at <|tool_response>; the result is filled in and the policy goes on in the same turn
    "gemma": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_response>', "Sunny.<turn|>",
              'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'),
}


def test_every_family_has_an_episode():
    assert set(EPISODES) == set(FAMILIES) == set(RENDERER)


class _PolicyEngine:
    """Replies the scripted texts with the log-probs ``model`` gives them (an on-policy sample)."""

    def __init__(self, tok, replies, model):
        self.tok, self.replies, self.model, self.policy_version = tok, list(replies), model, 0

    async def generate(self, prompt_ids, params):
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = sequence_logprobs(self.model, list(prompt_ids) + ids)[len(prompt_ids):]
        return Generation(tuple(ids), tuple(lp.tolist()), "stop", 0)


def _tiny_policy(vocab_size):
    """A 2-layer random Llama over the family tokenizer's whole vocabulary (added tokens included)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tool_episode_in_the_family_format_renders_its_deltas_and_trains_one_step(family_tokenizer, family):
    """Per family: the env driver decodes the sampled turns as the parser needs (special tokens kept
    where it reads them), the env sees the call and the reasoning-free reply, the observation delta
    is the template's own text for the tool result, the trained tokens are exactly the sampled ones,
    and one GRPO step on a tiny random policy carrying the template raises the log-prob of the
    rewarded episode's answer and lowers that of the other episode's."""
    import copy
    import dataclasses

    from relax_agent.config import TrainerConfig
    from relax_agent.train.backends.torch_backend import TorchTrainer
    from relax_agent.train.batch import collate, trajectory_advantages

    tok, parser = family_tokenizer(family), build_parser(family)
    call_turn, answer_turn, delta_text = EPISODES[family]
    replies = [call_turn, answer_turn]
    policy = _tiny_policy(len(tok))
    env, renderer = _WeatherEnv(), ChatRenderer(tok)
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=3, max_total_tokens=4096)
    traj = asyncio.run(run_episode(env, spec, _PolicyEngine(tok, replies, policy), renderer, parser, SamplingParams(64)))
    assert traj.error is None and traj.reward == 1.0
    assert _plain(parser.parse(_as_sampled(tok, parser, call_turn))) == CALLS[:1]
    assert [c["function"]["name"] for c in env.seen[0]["tool_calls"]] == ["get_weather"]
    assert env.seen[0].get("parse_errors") is None and env.seen[1]["content"] == "Sunny."
    assert "parse_errors" not in env.seen[1]
    assert json.dumps(env.seen[0]["tool_calls"][0]["function"]["arguments"]) == '{"city": "Paris", "days": 2}'
    sampled = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    assert [list(t.token_ids) for t in traj.turns] == sampled
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == [i for s in sampled for i in s]
    first_end = traj.turns[0].start + len(sampled[0])
    delta = list(traj.token_ids[first_end:traj.turns[1].start])
    assert tok.decode(delta) == delta_text and traj.loss_mask[first_end:traj.turns[1].start] == (0,) * len(delta)
    assert list(traj.token_ids[:traj.prompt_len]) == list(renderer.render_prompt(
        [{"role": "user", "content": "Weather in Paris?"}], TOOLS).token_ids)
    record = {"token_ids": list(traj.token_ids), "messages": list(traj.messages),
              "turns": [{"start": t.start, "token_ids": list(t.token_ids), "finish_reason": t.finish_reason}
                        for t in traj.turns]}
    assert check_deltas(record, renderer) == (None, None)  # the replay re-derives the same delta

    # one training step: this episode (reward 1) against one that answers "Rainy." (reward 0), a group of two
    other_replies = [call_turn, answer_turn.replace("Sunny.", "Rainy.")]
    other = asyncio.run(run_episode(_WeatherEnv(), spec, _PolicyEngine(tok, other_replies, policy), renderer, parser,
                                    SamplingParams(64)))
    other = dataclasses.replace(other, sample_id="g/1", reward=0.0)
    batch = collate([traj, other], trajectory_advantages([traj, other]), tok.pad_token_id or 0)
    assert [int(t) for t, m in zip(batch.input_ids[0], batch.loss_mask[0], strict=True) if m] == [i for s in sampled for i in s]
    trainer = TorchTrainer(copy.deepcopy(policy), TrainerConfig(lr=1e-2, micro_batch_size=2))
    metrics = trainer.train_step(batch)
    assert metrics[RATIO_MEAN] == pytest.approx(1.0, abs=1e-4)  # on-policy: the log-probs were the policy's

    def answer_logprob(model, t):
        with torch.no_grad():
            return float(sequence_logprobs(model, list(t.token_ids))[t.turns[1].start:].sum())

    assert answer_logprob(trainer.model, traj) > answer_logprob(policy, traj) + 1e-3
    assert answer_logprob(trainer.model, other) < answer_logprob(policy, other) - 1e-3


def test_a_run_with_tool_parser_auto_prints_the_choice_and_preflight_lets_it_through(family_tokenizer, capsys):
    from relax_agent.config import load_config
    from relax_agent.preflight import preflight
    from relax_agent.roles import resolved_parser_name

    cfg = load_config(None, ["rollout.tool_parser=auto", "run.device=cpu"])
    preflight(cfg)  # auto is resolved once the tokenizer is loaded, not refused as an unknown name
    assert resolved_parser_name(cfg, family_tokenizer("qwen3"), "Qwen/Qwen3-0.6B") == "qwen3"
    assert capsys.readouterr().err == "tool parser: qwen3 (chat template has <tool_call> JSON calls and <think> reasoning)\n"
    fixed = load_config(None, ["rollout.tool_parser=mistral"])
    assert resolved_parser_name(fixed, family_tokenizer("qwen3"), "x") == "mistral" and capsys.readouterr().err == ""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_envs_show_names_the_parser_auto_chooses_and_how_tools_are_rendered(family_tokenizer, family, tmp_path,
                                                                            tiny_model_dir):
    import shutil

    from typer.testing import CliRunner

    from relax_agent.cli import app

    family_tokenizer(family).save_pretrained(tmp_path)
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path)  # a model folder: only its tokenizer is loaded
    out = CliRunner().invoke(app, ["envs", "show", "relax/Calculator-v0", "--model", str(tmp_path)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert f"policy: {tmp_path}" in lines
    if family == "deepseek_v3":  # its template renders no tools
        assert "tool parser: hermes_strict (the chat template renders no tools; the Hermes system prompt asks for " \
               "<tool_call> JSON)" in lines
        assert "tools in: system prompt (the Hermes system prompt lists the tool schemas and asks for <tool_call> " \
               "JSON)" in lines
        return
    assert [line for line in lines if line.startswith("tool parser: ")] == \
        [f"tool parser: {family} ({resolve_tool_parser(family_tokenizer(family))[1]})"]
    assert "tools in: template (the chat template renders the tool schemas its own way)" in lines
    fixed = CliRunner().invoke(app, ["envs", "show", "relax/Calculator-v0", "--model", str(tmp_path), "--json",
                                     "--tool-parser", "hermes", "--tools-in", "system"])
    assert json.loads(fixed.output)["policy"] == {
        "model": str(tmp_path), "tool_parser": "hermes", "why": "rollout.tool_parser",
        "tools_in": "system prompt (the Hermes system prompt lists the tool schemas and asks for <tool_call> JSON)"}
    bad = CliRunner().invoke(app, ["envs", "show", "relax/Calculator-v0", "--model", str(tmp_path), "--tools-in", "x"])
    assert bad.exit_code == 2 and "--tools-in='x': expected one of auto, template, system" in bad.output


def test_gemma_names_each_tool_result_after_its_sampled_call(family_tokenizer):
    """Gemma 4 writes the tool's name in its result: taken from the sampled call with the result's
    ``tool_call_id``, else the call in the same position; a cut call turn's delta starts with the
    ``<|tool_response>`` that closes it."""
    tok = family_tokenizer("gemma")
    renderer = ChatRenderer(tok)
    calls = [{"id": "a1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
             {"id": "b2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    results = [{"role": "tool", "tool_call_id": "b2", "content": "sunny"},
               {"role": "tool", "tool_call_id": "zz", "content": "12:00"}]
    assert tok.decode(renderer.observation_delta(results, calls=calls)) == (
        'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
        '<|tool_response>response:get_weather{value:<|"|>12:00<|"|>}<tool_response|>')
    by_order = [{"role": "tool", "content": "12:00"}]
    assert tok.decode(renderer.observation_delta(by_order, closed=False, calls=calls)) == \
        '<|tool_response>response:get_time{value:<|"|>12:00<|"|>}<tool_response|>'


def test_glm_closes_a_turn_with_the_next_roles_token(family_tokenizer):
    """GLM-4.5+ writes no token after an assistant turn: the next role's token closes it. A turn the
    policy closed (it sampled that token) gets the rest; a cut turn's delta starts with that token."""
    tok = family_tokenizer("glm45")
    renderer = ChatRenderer(tok)
    tool = [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    user = [{"role": "user", "content": "And tomorrow?"}]
    assert tok.decode(renderer.observation_delta(tool)) == "\n<tool_response>\nsunny\n</tool_response><|assistant|>"
    assert tok.decode(renderer.observation_delta(tool, closed=False)) == \
        "<|observation|>\n<tool_response>\nsunny\n</tool_response><|assistant|>"
    assert tok.decode(renderer.observation_delta(user)) == "\nAnd tomorrow?<|assistant|>"
    assert tok.decode(renderer.observation_delta(user, closed=False)) == "<|user|>\nAnd tomorrow?<|assistant|>"
    assert {tok.convert_tokens_to_ids(t) for t in ("<|observation|>", "<|user|>")} <= renderer.stop_ids


@pytest.mark.parametrize("family", ["glm45", "qwen3_coder"])
def test_the_env_driver_types_bare_values_by_the_episodes_tool_schemas(family_tokenizer, family):
    """A city written ``75001`` reaches the env as the string "75001" (the schema says string) and
    ``days`` ``2`` as the number 2: the driver hands the episode's tools to the parser."""
    tok, parser = family_tokenizer(family), build_parser(family)
    call_turn, answer_turn, _ = EPISODES[family]
    replies = [call_turn.replace("Paris", "75001"), answer_turn]
    env = _WeatherEnv()
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=3, max_total_tokens=4096)
    traj = asyncio.run(run_episode(env, spec, _PolicyEngine(tok, replies, _tiny_policy(len(tok))), ChatRenderer(tok),
                                   parser, SamplingParams(64)))
    assert traj.error is None
    assert env.seen[0]["tool_calls"][0]["function"]["arguments"] == {"city": "75001", "days": 2}
