"""A synthetic run folder, laid out as ``relax-agent train`` writes one, for the viewer's tests.

Step 1 (complete): group ``s1/g0`` (task ``t-add``) with rewards 1.0 and 0.25, the second crossed by
a weight update and cut at ``length``; group ``s1/g1`` (task ``t-div``) with a failed episode (env
error, reward status ``error``) and a 0.5 one whose dump row also carries messages and the token
fields. Step 1's token record (``rollouts/tokens/step_000001.jsonl.gz``) holds the two-turn episode
``s1/g0/0``: prompt (2 tokens), turn 1 (2), a tool result (1), turn 2 (3). Step 2 (in progress): one
complete row, then a half-written line. ``metrics.jsonl`` also ends in a half-written line. One
evaluation after step 2 with a correct and a wrong sample. With ``tokenizer=True``, a word-level
tokenizer of :data:`VOCAB` in ``checkpoints/step_000001/model``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

SUMMARY = {"eval_end": {"eval/accuracy": 0.5, "eval/accuracy_std": 0.0, "eval/reward": 0.6, "eval/well_formed": 1.0},
           "last": {"step": 2, "rollout/reward": 0.75}, "checkpoint": "checkpoints/step_000002"}


def episode(sample_id: str, task_id: str, reward: float, **over: Any) -> dict[str, Any]:
    row = {
        "sample_id": sample_id, "task_id": task_id, "reward": reward, "reward_status": "ok",
        "metrics": {"correct": float(reward == 1.0), "well_formed": 1.0}, "stop_reason": "terminated",
        "error": None, "policy_versions": [3], "response": [f"answer of {sample_id}"], "token_versions": [[]],
        "sample_version": 3, "trained_at_version": 4, "trained": True, "dropped_stale": False, "filtered": False,
    }
    row.update(over)
    return row


STEP1 = [
    episode("s1/g0/0", "t-add", 1.0, response=["<tool_call>{\"name\": \"add\"}</tool_call>", "The sum is 5."],
            policy_versions=[3, 3], token_versions=[[], []]),
    episode("s1/g0/1", "t-add", 0.25, stop_reason="length", policy_versions=[3],
            token_versions=[[3, 3, 4, 4]], response=["cut off mid-sent"]),
    episode("s1/g1/0", "t-div", 0.0, reward_status="error", error="ZeroDivisionError: division by zero",
            stop_reason="env_error", trained=False),
    episode("s1/g1/1", "t-div", 0.5, dropped_stale=True, trained=False,
            messages=[{"role": "user", "content": "Divide 6 by 3."},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"function": {"name": "divide", "arguments": {"a": 6, "b": 3}}}]},
                      {"role": "tool", "name": "divide", "content": "2.0"},
                      {"role": "assistant", "content": "It is 2.", "parse_errors": ["unclosed <tool_call>"]}],
            token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 0, 1, 1, 0, 1],
            rollout_logprobs=[0.0, 0.0, -0.05, -2.5, 0.0, -0.7], prompt_len=2,
            token_text=["Div", "ide", "It", " is", "\n", " 2."], advantage=0.125),
]
VOCAB = {"[UNK]": 0, "Add": 10, " 2+3": 11, "<call>": 12, "add": 13, "5": 14, "The": 15, " sum": 16, " 5": 17}
TOKENS = {  # the token record of s1/g0/0, as write_token_record writes it
    "sample_id": "s1/g0/0", "task_id": "t-add", "sample_version": 3,
    "token_ids": [10, 11, 12, 13, 14, 15, 16, 17], "loss_mask": [0, 0, 1, 1, 0, 1, 1, 1],
    "rollout_logprobs": [0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -1.5, -0.01], "prompt_len": 2,
    "turns": [{"start": 2, "token_ids": [12, 13], "logprobs": [-0.1, -0.2], "policy_version": 3, "finish_reason": "stop"},
              {"start": 5, "token_ids": [15, 16, 17], "logprobs": [-0.3, -1.5, -0.01], "policy_version": 3,
               "finish_reason": "stop"}],
    "messages": [{"role": "user", "content": "Add 2+3"},
                 {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                 {"role": "tool", "name": "add", "content": "5"},
                 {"role": "assistant", "content": "The sum 5"}],
    "trainable": True, "media_kinds": [],
}
STEP2 = [episode("s2/g0/0", "t-mul", 0.75, sample_version=4, trained_at_version=5, filtered=True, trained=False)]

EVAL = [
    {"task_id": "h-1", "sample_id": "eval/g0/0", "seed": 0,
     "prompt": [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Rome?"}],
     "response": ["<tool_call>{\"name\": \"weather\", \"arguments\": {\"city\": \"Rome\"}}</tool_call>"],
     "parsed_calls": [{"calls": [{"name": "weather", "arguments": {"city": "Rome"}}]}], "conversation": [],
     "verdict": {"correct": 1.0, "reward": 1.0, "reason": "ok", "metrics": {}, "stop_reason": "terminated",
                 "error": None}},
    {"task_id": "h-2", "sample_id": "eval/g1/0", "seed": 0,
     "prompt": [{"role": "user", "content": "Weather in Paris?"}],
     "response": ["<tool_call>{\"name\": \"weather\", \"arguments\": {\"city\": \"Rome\"}}</tool_call>"],
     "parsed_calls": [{"calls": [{"name": "weather", "arguments": {"city": "Rome"}}]}], "conversation": [],
     "verdict": {"correct": 0.0, "reward": 0.2, "reason": "parameter 'city': 'Rome' is not one of ['Paris']",
                 "metrics": {}, "stop_reason": "terminated", "error": None}},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def make_run(root: Path, tokenizer: bool = False) -> Path:
    """Write the synthetic run under ``root / "run"`` and return that folder."""
    from PIL import Image

    run = root / "run"
    write_jsonl(run / "rollouts" / "step_000001.jsonl", STEP1)
    (run / "rollouts" / "tokens").mkdir(parents=True)
    with gzip.open(run / "rollouts" / "tokens" / "step_000001.jsonl.gz", "wt") as f:
        f.write(json.dumps(TOKENS) + "\n")
    if tokenizer:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
            run / "checkpoints" / "step_000001" / "model")
    write_jsonl(run / "rollouts" / "step_000002.jsonl", STEP2, tail='{"sample_id": "s2/g0/1", "rew')
    write_jsonl(run / "metrics.jsonl", [
        {"step": 1, "time": 1.0, "rollout/reward": 0.4375, "rollout/accuracy": 0.25, "rollout/well_formed": 1.0},
        {"step": 2, "time": 2.0, "rollout/reward": 0.75, "rollout/accuracy": 0.0, "rollout/well_formed": 1.0},
        {"step": 2, "time": 3.0, "eval/accuracy": 0.5, "eval/reward": 0.6, "eval/well_formed": 1.0,
         "eval/accuracy_std": 0.0},
    ], tail='{"step": 3, "time": 4.0, "rollout/rew')
    write_jsonl(run / "eval" / "step_000002.samples.jsonl", EVAL)
    write_jsonl(run / "sft.jsonl", [{"sft/step": 1, "sft/loss": 2.5}, {"sft/step": 2, "sft/loss": 1.25}])
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "plots").mkdir()
    Image.new("RGB", (40, 20), (30, 90, 200)).save(run / "plots" / "curves.png")
    return run
