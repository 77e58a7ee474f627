"""Content parts stay parts: a text-only policy refuses image/audio/video (at start-up with
check_media, or as a failed record naming the part and message), a media policy's template gets
them as parts."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from relax_agent.envs import TextEnv
from relax_agent.errors import ConfigError
from relax_agent.rollout.chat import ChatRenderer, check_media
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% else %}{{ '<' + p.type + '>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML that renders a media part as ``<{type}>`` (as multimodal templates put their image tokens)."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Engine:
    def __init__(self, tok):
        self.ids, self.policy_version = (tok.convert_tokens_to_ids("<|im_end|>"),), 0

    async def generate(self, prompt_ids, params):
        return Generation(self.ids, (-0.1,), "stop", 0)


class MediaEnv(TextEnv):
    def __init__(self, opening, step_obs=()):
        self.opening, self.step_obs = opening, list(step_obs)

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return self.opening, {"tools": []}

    def step(self, action):
        return self.step_obs, 1.0, not self.step_obs, False, {}


def play(renderer, env):
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=2)
    return asyncio.run(run_episode(env, spec, Engine(renderer.tokenizer), renderer, HermesParser(), SamplingParams(8)))


def test_check_media_names_the_message_and_part_type():
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE, AUDIO]}]
    with pytest.raises(ConfigError) as err:
        check_media(msgs, accepts_media=False, where="env.reset observation")
    assert "env.reset observation[1] has a 'image_url' content part (2 media parts in all)" in str(err.value)
    assert "text-only" in str(err.value)
    check_media(msgs, accepts_media=True)
    check_media([{"role": "user", "content": [{"type": "text", "text": "only text"}]}], accepts_media=False)


def test_an_image_in_the_prompt_of_a_text_only_policy_is_a_failed_record(tokenizer):
    env = MediaEnv([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}])
    traj = play(ChatRenderer(tokenizer), env)
    assert not traj.trainable and traj.reward_status == "error" and traj.turns == ()
    assert traj.error.startswith("ConfigError: messages[0] has a 'image_url' content part")


def test_audio_in_a_tool_result_for_a_text_only_policy_is_a_failed_record(tokenizer):
    env = MediaEnv([{"role": "user", "content": "go"}], [{"role": "user", "content": "x"}, {"role": "tool", "content": [AUDIO]}])
    traj = play(ChatRenderer(tokenizer), env)
    assert traj.reward_status == "error" and len(traj.turns) == 1
    assert traj.error.startswith("ConfigError: messages[1] has a 'input_audio' content part")


def test_text_parts_are_text_for_a_text_only_policy(tokenizer):
    env = MediaEnv([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    traj = play(ChatRenderer(tokenizer), env)
    assert traj.error is None and traj.messages[0]["content"] == "ab"
    assert "<|im_start|>user\nab<|im_end|>" in tokenizer.decode(traj.token_ids)


def test_a_media_policy_gets_the_parts_as_parts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = PARTS_TEMPLATE
    content = [{"type": "text", "text": "What is this? "}, IMAGE]
    traj = play(ChatRenderer(tok, accepts_media=True), MediaEnv([{"role": "user", "content": content}],
                                                                [{"role": "tool", "content": [AUDIO]}]))
    assert traj.error is None
    assert traj.messages[0]["content"] == content  # kept as parts, for the reward service too
    text = tok.decode(traj.token_ids)
    assert "<|im_start|>user\nWhat is this? <image_url><|im_end|>" in text
    assert "<|im_start|>tool\n<input_audio><|im_end|>" in text


@pytest.mark.parametrize("accepts_media", [False, True])
def test_an_unknown_content_part_is_refused_by_name_for_text_and_media_policies(tiny_model_dir, accepts_media):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = PARTS_TEMPLATE
    renderer = ChatRenderer(tok, accepts_media=accepts_media)
    for part, problem in (
            ({"type": "hologram", "hologram": {}}, r"messages\[0\] content part 1 has type 'hologram': not a part "
                                                   r"relax-agent knows, and a chat template would drop it silently; "
                                                   r"expected one of \['audio', 'image', 'image_url', 'input_audio', "
                                                   r"'input_image', 'input_text', 'text', 'video', 'video_url'\]"),
            ("just a string", r"messages\[0\] content part 1 has no type \(a str, not a dict\)"),
            ({"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}},
             r"messages\[0\] content part 1 has type 'file', which relax-agent cannot take: files are not media"),
            ({"type": "image_file", "image_file": {"file_id": "file-abc"}},
             r"messages\[0\] content part 1 has type 'image_file', which relax-agent cannot take: it names an "
             r"uploaded file by id")):
        with pytest.raises(ConfigError, match=problem):
            check_media([{"role": "user", "content": [{"type": "text", "text": "see"}, part]}], accepts_media)
        traj = play(renderer, MediaEnv([{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]))
        assert not traj.trainable and traj.turns == () and "content part 1 has" in traj.error  # never trained blind
    # in a tool result too: the episode fails there, naming the part
    traj = play(renderer, MediaEnv([{"role": "user", "content": "go"}],
                                   [{"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "chart"}]}]))
    assert len(traj.turns) == 1 and "env.step observation[0] content part 1 has type 'chart'" in traj.error


def test_responses_api_parts_are_read_as_their_chat_forms(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = PARTS_TEMPLATE
    url = IMAGE["image_url"]["url"]
    responses = [{"type": "input_text", "text": "What is this? "}, {"type": "input_image", "image_url": url}]
    chat = [{"type": "text", "text": "What is this? "}, IMAGE]
    a = play(ChatRenderer(tok, accepts_media=True), MediaEnv([{"role": "user", "content": responses}]))
    b = play(ChatRenderer(tok, accepts_media=True), MediaEnv([{"role": "user", "content": chat}]))
    assert a.error is None and a.token_ids == b.token_ids
    assert "<|im_start|>user\nWhat is this? <image_url><|im_end|>" in tok.decode(a.token_ids)
    text_only = play(ChatRenderer(tok), MediaEnv([{"role": "user", "content": [{"type": "input_text", "text": "ab"}]}]))
    assert text_only.error is None and text_only.messages[0]["content"] == "ab"
    with pytest.raises(ConfigError, match=r"has a 'input_image' content part.*text-only"):
        check_media([{"role": "user", "content": responses}], accepts_media=False)
