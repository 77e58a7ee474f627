"""relax/DatasetTools-v0 on small files this test writes: JSON lines, parquet, a folder via path=."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers relax/DatasetTools-v0)
from relax_agent.envs.dataset_tools import DatasetToolsEnv, exact_calls
from relax_agent.envs.testing import run_contract
from relax_agent.errors import ConfigError, DataError, EnvError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"name": "get_time", "description": "Local time.", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}


def rows(n: int = 12) -> list[dict]:
    out = []
    for i in range(n):
        city = f"City{i}"
        out.append({"id": f"q{i}", "prompt": f"What is the weather in {city}?", "tools": [WEATHER, TIME],
                    "answer": [{"name": "get_weather", "arguments": {"city": city}}]})
    return out


def write_jsonl(path: Path, data: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]}


def test_jsonl_rows_become_tasks_and_calls_are_scored(tmp_path):
    env = gymnasium.make("relax/DatasetTools-v0", data_files=str(write_jsonl(tmp_path / "d.jsonl", rows())),
                         heldout_fraction=0.25)
    inner = env.unwrapped
    train, heldout = inner.tasks("train"), inner.tasks("heldout")
    assert len(train) + len(heldout) == 12 and not {t["id"] for t in train} & {t["id"] for t in heldout}
    task = next(t for t in train + heldout if t["id"] == "q3")
    messages, info = env.reset(options={"task": task})
    assert messages == [{"role": "user", "content": "What is the weather in City3?"}] and info["task_id"] == "q3"
    assert [t["function"]["name"] for t in info["tools"]] == ["get_weather", "get_time"]  # bare docs are wrapped
    assert info["tools"][1]["type"] == "function"
    obs, reward, terminated, truncated, info = env.step(call("get_weather", city="City3"))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False) and info["reason"] == "ok"
    env.reset(options={"task": task})
    _, reward, _, _, info = env.step(call("get_weather", city="Paris"))
    assert reward == 0.0 and info["correct"] == 0.0 and info["well_formed"] == 1.0 and "Paris" in info["reason"]
    env.reset(options={"task": task})
    _, reward, _, _, info = env.step({"role": "assistant", "content": "Sunny.", "tool_calls": []})
    assert reward == 0.0 and info["reason"] == "no tool call"
    with pytest.raises(EnvError, match="reset"):
        env.step(call("get_weather", city="City3"))
    env.close()


def test_exact_calls_rules():
    task = {"id": "t", "answer": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]}
    two = {"tool_calls": [{"function": {"name": "g", "arguments": "{}"}}, {"function": {"name": "f", "arguments": {"x": 1}}}]}
    assert exact_calls(two, task)[0] == 1.0  # order-free, JSON-string arguments decoded
    assert exact_calls({"tool_calls": two["tool_calls"][:1]}, task)[0] == 0.0
    assert exact_calls({**two, "parse_errors": ["bad"]}, task)[1]["reason"].startswith("a tool call did not parse")
    assert exact_calls({"content": "no"}, {"id": "t", "answer": []})[0] == 1.0  # the answer is "no call"
    with pytest.raises(DataError, match="not a list"):
        exact_calls({}, {"id": "t", "answer": "Paris"})


def test_parquet_column_mapping_and_custom_scorer(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    data = [{"qid": f"p{i}", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}],
             "functions": json.dumps([WEATHER]), "target": str(i + 1)} for i in range(10)]
    datasets.Dataset.from_list(data).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "my_scoring.py").write_text(
        "def score(message, task, bonus=0.0):\n"
        "    ok = message['content'].strip() == task['answer']\n"
        "    return float(ok) + bonus, {'correct': float(ok), 'reason': 'ok' if ok else 'wrong sum'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = DatasetToolsEnv(data_files=str(tmp_path / "d.parquet"), heldout_fraction=0.0,
                          columns={"prompt": "messages", "tools": "functions", "answer": "target", "id": "qid"},
                          scorer="my_scoring:score", scorer_kwargs={"bonus": 0.5})
    task = next(t for t in env.tasks("train") if t["id"] == "p4")
    assert task["answer"] == 5  # a JSON string answer is decoded
    messages, info = env.reset(options={"task": {**task, "answer": "5"}})
    assert [m["role"] for m in messages] == ["system", "user"] and info["tools"] == [WEATHER]
    _, reward, _, _, info = env.step({"role": "assistant", "content": " 5 "})
    assert reward == 1.5 and info == {"correct": 1.0, "reason": "ok"}


def test_path_loads_a_local_folder(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows(6))
    env = DatasetToolsEnv(path=str(folder), heldout_fraction=0.0)
    assert sorted(t["id"] for t in env.tasks("train")) == [f"q{i}" for i in range(6)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "exactly one of data_files"),
    ({"data_files": "x.jsonl", "path": "org/ds"}, "exactly one of data_files"),
    ({"data_files": "notes.txt"}, "expected files ending in"),
    ({"data_files": "missing.jsonl"}, "is not a file"),
    ({"columns": {"question": "q"}}, "unknown roles"),
    ({"columns": {"prompt": "question"}}, "prompt column 'question' is not in the dataset"),
    ({"columns": {"tools": "functions"}}, "tools column 'functions'"),
    ({"scorer": "no_colon"}, "expected 'module:function'"),
    ({"scorer": "relax_agent.no_such_module:f"}, "cannot import"),
    ({"scorer": "json:no_such_function"}, "has no 'no_such_function'"),
    ({"split": "test"}, "split='test'"),
])
def test_bad_arguments_are_config_errors(tmp_path, kwargs, match):
    good = str(write_jsonl(tmp_path / "d.jsonl", rows(4)))
    if "data_files" not in kwargs and "path" not in kwargs and kwargs:
        kwargs = {"data_files": good, **kwargs}
    elif kwargs.get("data_files") in ("notes.txt", "missing.jsonl"):
        kwargs = {"data_files": str(tmp_path / kwargs["data_files"])}
        if kwargs["data_files"].endswith(".txt"):
            Path(kwargs["data_files"]).write_text("x")
    with pytest.raises(ConfigError, match=match):
        DatasetToolsEnv(**kwargs)


def test_malformed_rows_and_scorers_are_named(tmp_path, monkeypatch):
    bad = rows(3)
    bad[1]["prompt"] = 7
    with pytest.raises(DataError, match=r"row 1 \(id 'q1'\): prompt must be"):
        DatasetToolsEnv(data_files=str(write_jsonl(tmp_path / "bad.jsonl", bad)))
    dup = rows(3)
    dup[2]["id"] = "q0"
    with pytest.raises(DataError, match="repeated: \\['q0'\\]"):
        DatasetToolsEnv(data_files=str(write_jsonl(tmp_path / "dup.jsonl", dup)))
    (tmp_path / "bad_scoring.py").write_text("def score(message, task):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = DatasetToolsEnv(data_files=str(write_jsonl(tmp_path / "d.jsonl", rows(3))), scorer="bad_scoring:score")
    env.reset(seed=0)
    with pytest.raises(EnvError, match="returned reward"):
        env.step({"role": "assistant", "content": "x"})


def test_contract_suite_passes(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", rows(20)))
    assert run_contract(lambda: gymnasium.make("relax/DatasetTools-v0", data_files=path)) == {}
