"""What trains in an agent episode is the chain of replies the agent kept: abandoned requests, side
calls after the answer and unchosen ``n > 1`` siblings are side branches (counted, never trained or
scored); a fixed ``seed`` from the agent neither collapses a group nor repeats a sample. Each test
runs a real agent process (the ``openai`` SDK) against the endpoint on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from relax_agent.config import ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.proxy.session import mixed_seed
from tests.unit.test_agent_driver import ONE_CALL, TASK, _driver, _ids, _play
from tests.unit.test_endpoint_openai import ScriptedEngine

ANSWER = f"Answer: {TASK['answer']}"
WRONG = f"Answer: {TASK['answer'] + 1}"


@pytest.fixture
def tmp_path(open_dir):
    """pytest's own tmp_path is reachable by root only: the agents here run as an unprivileged uid."""
    return open_dir


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


class CallEngine:
    """Reply ``k`` of ``script`` to the k-th call, each token after ``delay_s`` (streams like the HF engine)."""

    def __init__(self, script):
        self.script = script
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []
        self.policy_version = 0

    async def generate(self, prompt_ids, params: SamplingParams, on_token=None) -> Generation:
        ids, delay_s = self.script[len(self.prompts)]
        self.prompts.append(list(prompt_ids))
        self.seeds.append(params.seed)
        for t in ids:
            await asyncio.sleep(delay_s)
            if on_token is not None:
                on_token(t, -0.5, 0)
        return Generation(tuple(ids), tuple(-0.5 for _ in ids), "stop", 0)


ABANDON = """
import json, os, time
import openai
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
try:  # the first attempt is given up on by the client
    openai.OpenAI(max_retries=0, timeout=0.5).chat.completions.create(model="policy", messages=task["messages"])
    raise SystemExit("the slow request was expected to time out")
except openai.APITimeoutError:
    pass
reply = openai.OpenAI(max_retries=0).chat.completions.create(model="policy", messages=task["messages"])
time.sleep(2.5)  # the abandoned request finishes before the agent exits
"""


def test_an_abandoned_request_that_finishes_last_is_not_the_trained_episode(tok, tmp_path):
    slow, fast = _ids(tok, WRONG), _ids(tok, ANSWER)
    engine = CallEngine([(slow, 1.5 / len(slow)), (fast, 0.0)])
    traj = _play(_driver(tok, engine, tmp_path, ABANDON))
    assert len(engine.prompts) == 2, "the agent did not make both requests"
    assert traj.error is None, traj.error
    assert [list(t.token_ids) for t in traj.turns] == [fast]
    assert traj.reward == 1.0  # the env scored the reply the agent got, not the abandoned one
    assert traj.metrics["agent/chain_replies"] == 1.0 and traj.metrics["agent/dropped_replies"] == 1.0
    assert traj.metrics["agent/dropped_tokens"] == float(len(slow))
    assert traj.metrics["agent/undelivered"] == 1.0


SIDE_CALL = ONE_CALL + """
title = OpenAI().chat.completions.create(model="policy", messages=[
    {"role": "user", "content": "Give this conversation a short title: " + (reply.choices[0].message.content or "")}])
"""


def test_a_side_call_after_the_answer_is_neither_trained_nor_scored(tok, tmp_path):
    answer, title = _ids(tok, ANSWER), _ids(tok, "Adding numbers")
    engine = CallEngine([(answer, 0.0), (title, 0.0)])
    traj = _play(_driver(tok, engine, tmp_path, SIDE_CALL))
    assert traj.error is None, traj.error
    assert [list(t.token_ids) for t in traj.turns] == [answer] and traj.reward == 1.0
    assert traj.metrics["agent/dropped_replies"] == 1.0 and traj.metrics["agent/branches"] == 1.0
    (side,) = traj.side_segments  # recorded beside the episode, not lost
    assert side.sample_id == f"{traj.sample_id}/seg1" and [list(t.token_ids) for t in side.turns] == [title]


def test_side_segments_follow_their_episode_in_the_rollout_dump_untrained(tok, tmp_path):
    import json

    from relax_agent import records as R
    from relax_agent.control.reporting import write_rollout_dump

    answer, title = _ids(tok, ANSWER), _ids(tok, "Adding numbers")
    traj = _play(_driver(tok, CallEngine([(answer, 0.0), (title, 0.0)]), tmp_path, SIDE_CALL))
    slim = R.trajectory_fields([traj])[R.TRAJECTORY][0]  # what the loop reads from the bus
    path = tmp_path / "step_000001.jsonl"
    write_rollout_dump(path, [(slim, 0)], 1, {traj.sample_id}, set(), tok.decode)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["sample_id"], r["trained"], r.get("side_branch_of")) for r in rows] == [
        (traj.sample_id, True, None), (f"{traj.sample_id}/seg1", False, traj.sample_id)]
    assert rows[1]["response"] == [tok.decode(title)] and rows[1]["reward"] == rows[0]["reward"]


MULTI_TURN_ABANDON = """
import json, os, time
import openai
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
messages = list(task["messages"])
try:
    openai.OpenAI(max_retries=0, timeout=0.5).chat.completions.create(model="policy", messages=messages,
                                                                     tools=task["tools"])
except openai.APITimeoutError:
    pass
client = openai.OpenAI(max_retries=0)
first = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"]).choices[0].message
messages += [first.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": str(task["metadata"]["answer"])}]
client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
time.sleep(2.5)
"""


def test_the_chain_follows_the_reply_sent_back_past_an_abandoned_one(tok, tmp_path):
    a, op, b = TASK["expression"].split()
    name = {"+": "add", "-": "subtract"}[op]
    call = _ids(tok, f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')
    slow, final = _ids(tok, WRONG), _ids(tok, ANSWER)
    engine = CallEngine([(slow, 2.5 / len(slow)), (call, 0.0), (final, 0.0)])
    traj = _play(_driver(tok, engine, tmp_path, MULTI_TURN_ABANDON, task_keys=["answer"]))
    assert traj.error is None, traj.error
    assert [list(t.token_ids) for t in traj.turns] == [call, final] and traj.reward == 1.0
    assert [list(t.logprobs) for t in traj.turns] == [[-0.5] * len(call), [-0.5] * len(final)]
    assert traj.metrics["agent/chain_replies"] == 2.0 and traj.metrics["agent/dropped_replies"] == 1.0


PICK_SECOND = ONE_CALL.replace('tools=task["tools"])', 'tools=task["tools"], n=3)') + """
best = [c.message.content for c in reply.choices if c.message.content.startswith("Answer: " + str(task["metadata"]["answer"]))]
json.dump({"answer": best[0]}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""


def test_the_sibling_the_agent_answered_with_is_the_trained_one(tok, tmp_path):
    replies = [_ids(tok, WRONG), _ids(tok, ANSWER), _ids(tok, "I am not sure")]
    engine = CallEngine([(r, 0.0) for r in replies])
    traj = _play(_driver(tok, engine, tmp_path, PICK_SECOND, task_keys=["answer"]))
    assert traj.error is None, traj.error
    assert [list(t.token_ids) for t in traj.turns] == [replies[1]] and traj.reward == 1.0
    assert traj.metrics["agent/siblings"] == 2.0 and traj.metrics["agent/dropped_replies"] == 2.0


FIXED_SEED = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
for _ in range(2):  # e.g. self-consistency with the seed a framework fixed
    OpenAI(max_retries=0).chat.completions.create(model="policy", messages=task["messages"], seed=7)
"""


class SeedEngine(ScriptedEngine):
    """Replies with the text of its sampling seed (a policy whose sample is a function of the seed)."""

    def __init__(self, tok):
        super().__init__(lambda prompt: _ids(tok, f"seed {self.seed}"))
        self.seed = None

    async def generate(self, prompt_ids, params, on_token=None):
        self.seed = params.seed
        return await super().generate(prompt_ids, params, on_token)


def _play_group(driver, seeds):
    async def main():
        return [await driver.play(EpisodeSpec(f"g/{i}", "g", TASK["id"], TASK, seed=s), SamplingParams(max_new_tokens=32))
                for i, s in enumerate(seeds)]

    try:
        return asyncio.run(main())
    finally:
        driver.close()


def test_a_fixed_agent_seed_is_mixed_with_the_episode_seed(tok, tmp_path):
    engine = SeedEngine(tok)
    first, second = _play_group(_driver(tok, engine, tmp_path, FIXED_SEED), seeds=[3, 4])
    assert first.error is None and second.error is None, (first.error, second.error)
    texts = [tok.decode(t.token_ids, skip_special_tokens=True) for t in (first.turns[0], second.turns[0])]
    assert texts == [f"seed {mixed_seed(7, 3, 0)}", f"seed {mixed_seed(7, 4, 0)}"] and texts[0] != texts[1]
    assert first.metrics["agent/duplicate_replies"] == 0.0  # the two requests of one episode differ too
    assert second.metrics["agent/group_duplicates"] == 0.0


def test_duplicate_replies_are_counted_in_the_episode_and_the_group(tok, tmp_path):
    engine = ScriptedEngine(_ids(tok, ANSWER))  # ignores the seed: every sample is the same
    first, second = _play_group(_driver(tok, engine, tmp_path, FIXED_SEED), seeds=[3, 4])
    assert first.metrics["agent/duplicate_replies"] == 1.0 and second.metrics["agent/duplicate_replies"] == 1.0
    assert first.metrics["agent/group_duplicates"] == 0.0 and second.metrics["agent/group_duplicates"] == 1.0


def test_mixed_seeds_are_in_range_and_deterministic():
    seeds = {mixed_seed(7, e, k) for e in range(50) for k in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**31 - 65 for s in seeds)
    assert mixed_seed(-(2**63), 2**40, 3) == mixed_seed(-(2**63), 2**40, 3)


def test_with_train_branches_a_side_segment_trains_with_its_episodes_advantage(tok, tmp_path):
    """``rollout.agent.train_branches``: the trainer's fields gain one row per side segment, with the
    segment's own tokens, mask and log-probs and its episode's advantage; a row that is not trainable
    adds none; the rollout dump marks the segment trained with its episode."""
    import json

    import numpy as np

    from relax_agent import records as R
    from relax_agent.control.reporting import write_rollout_dump
    from relax_agent.errors import DataError
    from relax_agent.train.collate import collate_fields, with_segments

    answer, title = _ids(tok, ANSWER), _ids(tok, "Adding numbers")
    traj = _play(_driver(tok, CallEngine([(answer, 0.0), (title, 0.0)]), tmp_path, SIDE_CALL))
    fields = R.trajectory_fields([traj, traj])  # as the trainer reads them from the bus
    fields[R.ADVANTAGE] = [np.float32(0.75), np.float32(-0.5)]
    fields[R.TRAINABLE] = np.asarray([True, False])
    (side,) = traj.side_segments
    assert with_segments(fields, side_branches=False)[1:] == (0, 0)  # without train_branches: no extra row
    out, contexts, added = with_segments(fields)
    assert contexts == 0 and added == 1 and R.TRAJECTORY not in out and len(out[R.TOKEN_IDS]) == 3
    assert list(out[R.TOKEN_IDS][2]) == list(side.token_ids) and list(out[R.LOSS_MASK][2]) == list(side.loss_mask)
    assert list(out[R.ROLLOUT_LOGPROBS][2]) == pytest.approx(list(side.rollout_logprobs))
    assert float(out[R.ADVANTAGE][2]) == 0.75 and out[R.MEDIA][2] is None
    batch = collate_fields(out, tok.pad_token_id or 0)
    assert batch.loss_mask[2].sum().item() == len(title) and batch.advantages.tolist() == [0.75, -0.5, 0.75]
    with pytest.raises(DataError, match="trajectory"):
        with_segments({k: v for k, v in fields.items() if k != R.TRAJECTORY})
    path = tmp_path / "step_000001.jsonl"
    slim = fields[R.TRAJECTORY][0]
    write_rollout_dump(path, [(slim, 0)], 1, {traj.sample_id}, set(), tok.decode, train_branches=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["trained"], r.get("side_branch_of")) for r in rows] == [(True, None), (True, traj.sample_id)]


def _call_ids(tok):
    a, op, b = TASK["expression"].split()
    name = {"+": "add", "-": "subtract"}[op]
    return _ids(tok, f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')


def _trained_replies(traj):
    """[k] the sampled replies every trained record holds, context by context, and the loss-masked
    tokens over all of them."""
    replies = [[list(t.token_ids) for t in seg.turns] for seg in traj.segments]
    return replies, sum(sum(seg.loss_mask) for seg in traj.segments)


ANNOTATED = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
messages = list(task["messages"])
reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"]).choices[0].message
call = reply.tool_calls[0]
messages += [{"role": "assistant", "content": "[step 1] I call a tool.",  # the framework annotates its history
              "tool_calls": [{"id": "tc-1", "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": "tc-1", "content": str(task["metadata"]["answer"])}]
client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
"""


def test_an_agent_that_annotates_its_history_is_scored_on_its_last_reply_and_trains_both(tok, tmp_path):
    import numpy as np

    from relax_agent import records as R
    from relax_agent.train.collate import with_segments

    call, final = _call_ids(tok), _ids(tok, ANSWER)
    traj = _play(_driver(tok, CallEngine([(call, 0.0), (final, 0.0)]), tmp_path, ANNOTATED, task_keys=["answer"]))
    assert traj.error is None, traj.error
    assert traj.reward == 1.0  # the delivered answer, not the tool call of the first request
    assert _trained_replies(traj) == ([[call], [final]], len(call) + len(final))  # each reply trained once
    (ctx,) = traj.context_segments
    assert ctx.sample_id == f"{traj.sample_id}/ctx0" and ctx.stop_reason == "context" and ctx.reward == 1.0
    assert traj.side_segments == ()
    assert traj.metrics["agent/chain_replies"] == 2.0 and traj.metrics["agent/dropped_replies"] == 0.0
    assert traj.metrics["agent/continuations"] == 1.0 and traj.metrics["agent/branches"] == 0.0
    assert traj.metrics["agent/contexts"] == 2.0
    fields = R.trajectory_fields([traj])
    fields[R.ADVANTAGE] = [np.float32(0.5)]
    out, contexts, side = with_segments(fields, side_branches=False)
    assert (contexts, side) == (1, 0) and list(out[R.TOKEN_IDS][1]) == list(ctx.token_ids)
    assert [float(a) for a in out[R.ADVANTAGE]] == [0.5, 0.5]


TOOLLESS_FINAL = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
messages = list(task["messages"])
reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"]).choices[0].message
messages += [reply.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": str(task["metadata"]["answer"])},
             {"role": "user", "content": "Now give the final answer."}]
client.chat.completions.create(model="policy", messages=messages)  # the fallback: no tools this time
"""


def test_a_final_request_without_tools_is_what_the_env_scores(tok, tmp_path):
    call, final = _call_ids(tok), _ids(tok, ANSWER)
    traj = _play(_driver(tok, CallEngine([(call, 0.0), (final, 0.0)]), tmp_path, TOOLLESS_FINAL, task_keys=["answer"]))
    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and [list(t.token_ids) for t in traj.turns] == [final]
    assert _trained_replies(traj) == ([[call], [final]], len(call) + len(final))
    assert traj.messages[-1]["content"] == ANSWER and traj.side_segments == ()
    assert traj.metrics["agent/dropped_replies"] == 0.0


RETEMPLATED = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
client = OpenAI(max_retries=0)
history = []  # (role, text) as the framework keeps it: whitespace collapsed, its own prefix on replies

def ask():
    messages = list(task["messages"])
    for role, text in history:
        messages.append({"role": role, "content": ("Assistant said: " + text) if role == "assistant" else text})
    text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    history.append(("assistant", " ".join(text.split())))

for follow_up in ("Go on.", "And the result?", None):
    ask()
    if follow_up:
        history.append(("user", follow_up))
"""


def test_a_re_templating_framework_trains_every_reply_once_and_is_scored_on_its_last(tok, tmp_path):
    replies = [_ids(tok, "Let me  think\n\nstep by step."), _ids(tok, "First   the operands."), _ids(tok, ANSWER)]
    traj = _play(_driver(tok, CallEngine([(r, 0.0) for r in replies]), tmp_path, RETEMPLATED))
    assert traj.error is None, traj.error
    assert traj.reward == 1.0
    assert _trained_replies(traj) == ([[r] for r in replies], sum(map(len, replies)))
    assert [s.sample_id for s in traj.context_segments] == [f"{traj.sample_id}/ctx0", f"{traj.sample_id}/ctx1"]
    assert traj.metrics["agent/continuations"] == 2.0 and traj.metrics["agent/dropped_replies"] == 0.0


ABANDONED_FOLLOW_UP = """
import json, os, time
import openai
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
messages = list(task["messages"])
reply = openai.OpenAI(max_retries=0).chat.completions.create(model="policy", messages=messages).choices[0].message
messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
try:  # a self-check the agent gives up on: it keeps its first answer
    openai.OpenAI(max_retries=0, timeout=0.5).chat.completions.create(model="policy", messages=messages)
    raise SystemExit("the slow request was expected to time out")
except openai.APITimeoutError:
    pass
time.sleep(2.5)  # the abandoned request finishes before the agent exits
"""


def test_a_follow_up_the_agent_hung_up_on_does_not_end_the_chain(tok, tmp_path):
    answer, slow = _ids(tok, ANSWER), _ids(tok, WRONG)
    engine = CallEngine([(answer, 0.0), (slow, 1.5 / len(slow))])
    traj = _play(_driver(tok, engine, tmp_path, ABANDONED_FOLLOW_UP))
    assert len(engine.prompts) == 2, "the agent did not make both requests"
    assert traj.error is None, traj.error
    assert [list(t.token_ids) for t in traj.turns] == [answer] and traj.reward == 1.0  # the answer it got
    assert traj.metrics["agent/dropped_replies"] == 1.0 and traj.metrics["agent/undelivered"] == 1.0
    (side,) = traj.side_segments  # the whole conversation, the abandoned reply included, untrained
    assert [list(t.token_ids) for t in side.turns] == [answer, slow]
    start = side.turns[1].start  # the answer it holds is masked (trained once, in the trajectory), the rest not
    assert sum(side.loss_mask) == len(slow) and list(side.loss_mask[start:]) == [1] * len(slow)
