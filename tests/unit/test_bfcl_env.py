"""BFCL data loading, splits, and BFCLEnv reset/step on real tasks."""

from __future__ import annotations

import json

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers the relax/ ids)
from relax_agent.envs.bfcl import ENV_IDS, data
from relax_agent.envs.bfcl.data import CATEGORIES, heldout_score, load_tasks, split_tasks
from relax_agent.envs.bfcl.env import BFCLEnv, calls_from_message
from relax_agent.errors import ConfigError, DataError, EnvError

# (total, train, heldout) at heldout_fraction=0.2: pinned so a change of split is noticed.
COUNTS = {
    "simple_python": (400, 327, 73),
    "multiple": (200, 161, 39),
    "parallel": (200, 162, 38),
    "parallel_multiple": (200, 159, 41),
    "irrelevance": (240, 190, 50),
    "simple_java": (100, 81, 19),
    "simple_javascript": (50, 41, 9),
    "live_simple": (258, 211, 47),
    "live_multiple": (1053, 858, 195),
    "live_parallel": (16, 15, 1),
    "live_parallel_multiple": (24, 17, 7),
    "live_irrelevance": (884, 713, 171),
    "live_relevance": (16, 14, 2),
}


def _call(name: str, arguments) -> dict:
    tool_call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [tool_call]}


def _task(category: str, task_id: str) -> dict:
    return next(t for t in load_tasks(category) if t["id"] == task_id)


# ---------------------------------------------------------------- data
@pytest.mark.parametrize("category", CATEGORIES)
def test_task_counts_and_fields(category):
    tasks = load_tasks(category)
    total, train, heldout = COUNTS[category]
    assert len(tasks) == total
    assert len({t["id"] for t in tasks}) == total
    for t in tasks:
        assert t["category"] == category
        # live tasks may open with earlier conversation turns (live_irrelevance_*: assistant replies too)
        assert t["question"] and all(m["role"] in ("system", "user", "assistant") for m in t["question"])
        assert t["question"][-1]["role"] == "user"
        assert [tool["function"]["name"] for tool in t["tools"]] == [f["name"] for f in t["functions"]]
        assert (t["possible_answer"] == []) == (t["expect"] != "calls")
        assert t["expect"] == {"irrelevance": "no_call", "live_irrelevance": "no_call",
                               "live_relevance": "a_call"}.get(category, "calls")
    assert (len(split_tasks(tasks, "train")), len(split_tasks(tasks, "heldout"))) == (train, heldout)


def test_split_is_stable_and_disjoint():
    tasks = load_tasks("simple_python")
    train, heldout = split_tasks(tasks, "train"), split_tasks(tasks, "heldout")
    ids_train, ids_heldout = {t["id"] for t in train}, {t["id"] for t in heldout}
    assert not ids_train & ids_heldout
    assert ids_train | ids_heldout == {t["id"] for t in tasks}
    first_ids = ["simple_python_4", "simple_python_11", "simple_python_18", "simple_python_23", "simple_python_37"]
    assert [t["id"] for t in heldout[:5]] == first_ids
    assert heldout_score("simple_python_0") == pytest.approx(0.464811142337283, abs=1e-15)
    assert split_tasks(tasks, "heldout") == heldout  # same call, same answer
    assert split_tasks(tasks, "heldout", heldout_fraction=0.0) == []
    assert split_tasks(tasks, "train", heldout_fraction=1.0) == []
    # a larger fraction only moves tasks from train to heldout
    assert ids_heldout <= {t["id"] for t in split_tasks(tasks, "heldout", heldout_fraction=0.5)}


def test_bad_split_and_category_are_named():
    with pytest.raises(DataError, match="'test'"):
        split_tasks(load_tasks("parallel"), "test")
    with pytest.raises(DataError, match="'web_search'"):
        load_tasks("web_search")


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps bfcl-eval"):
        data.data_dir()


# ---------------------------------------------------------------- env
def test_reset_and_step_on_a_real_task():
    env = BFCLEnv(category="simple_python")
    task = _task("simple_python", "simple_python_1")  # math.factorial(number=5)
    messages, info = env.reset(seed=0, options={"task": task})
    assert messages == [{"role": "user", "content": "Calculate the factorial of 5 using math functions."}]
    assert info["task_id"] == "simple_python_1"
    assert info["tools"][0]["function"]["name"] == "math.factorial"
    assert info["tools"][0]["function"]["parameters"]["properties"]["number"]["type"] == "integer"

    obs, reward, terminated, truncated, info = env.step(_call("math.factorial", json.dumps({"number": 5})))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info == {"correct": 1.0, "well_formed": 1.0, "num_calls": 1, "reason": "ok"}

    env.reset(options={"task": task})
    _, reward, _, _, info = env.step(_call("math.factorial", {"number": 6}))
    assert reward == pytest.approx(0.1)
    assert (info["correct"], info["well_formed"], info["num_calls"]) == (0.0, 1.0, 1)
    assert "'number'" in info["reason"]


def test_wrong_actions_get_zero():
    env = BFCLEnv(category="simple_python", partial_credit=0.25)
    task = _task("simple_python", "simple_python_1")
    for action in [
        _call("math.factorial", '{"number": 5'),  # JSON that does not parse
        _call("factorial", {"number": 5}),  # not a task function
        {"role": "assistant", "content": "The factorial of 5 is 120."},  # no call
    ]:
        env.reset(options={"task": task})
        _, reward, terminated, _, info = env.step(action)
        assert (reward, terminated, info["correct"], info["well_formed"]) == (0.0, True, 0.0, 0.0), action
    env.reset(options={"task": task})
    assert env.step(_call("math.factorial", {"number": 4}))[1] == 0.25


def test_parallel_task_order_free_and_irrelevance():
    env = BFCLEnv(category="parallel")
    task = _task("parallel", "parallel_0")  # spotify.play for Taylor Swift (20) and Maroon 5 (15)
    env.reset(options={"task": task})
    action = _call("spotify.play", '{"artist": "maroon 5", "duration": 15}')
    action["tool_calls"] += _call("spotify.play", '{"artist": "Taylor Swift", "duration": 20}')["tool_calls"]
    _, reward, _, _, info = env.step(action)
    assert (reward, info["num_calls"]) == (1.0, 2)

    env = BFCLEnv(category="irrelevance")
    task = load_tasks("irrelevance")[0]
    env.reset(options={"task": task})
    assert env.step({"role": "assistant", "content": "I cannot do that with these tools."})[1] == 1.0
    env.reset(options={"task": task})
    assert env.step(_call(task["functions"][0]["name"], {}))[1] == 0.0


def test_reset_without_task_draws_from_the_configured_split():
    env = BFCLEnv(category="multiple", split="heldout")
    heldout_ids = {t["id"] for t in env.tasks("heldout")}
    drawn = [env.reset(seed=s)[1]["task_id"] for s in range(20)]
    assert set(drawn) <= heldout_ids
    assert drawn == [env.reset(seed=s)[1]["task_id"] for s in range(20)]  # seeded draws repeat
    assert len(set(drawn)) > 5


def test_reset_returns_copies():
    env = BFCLEnv()
    task = _task("simple_python", "simple_python_1")
    messages, info = env.reset(options={"task": task})
    messages[0]["content"] = "changed"
    info["tools"].clear()
    assert task["question"][0]["content"].startswith("Calculate")
    assert task["tools"]


def test_step_needs_a_fresh_episode():
    env = BFCLEnv()
    with pytest.raises(EnvError, match="reset"):
        env.step(_call("math.factorial", {"number": 5}))
    env.reset(options={"task": _task("simple_python", "simple_python_1")})
    env.step(_call("math.factorial", {"number": 5}))
    with pytest.raises(EnvError, match="reset"):
        env.step(_call("math.factorial", {"number": 5}))


@pytest.mark.parametrize(
    "kwargs", [{"category": "web_search"}, {"split": "test"}, {"heldout_fraction": 1.5}, {"partial_credit": -0.1}]
)
def test_bad_kwargs_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        BFCLEnv(**kwargs)


@pytest.mark.parametrize(("env_id", "category"), sorted(ENV_IDS.items()))
def test_registered_ids_make_the_env(env_id, category):
    env = gymnasium.make(env_id, partial_credit=0.2)
    assert isinstance(env.unwrapped, BFCLEnv)
    assert (env.unwrapped.category, env.unwrapped.partial_credit) == (category, 0.2)
    messages, info = env.reset(seed=3)
    assert env.observation_space.contains(messages)
    assert info["task_id"].startswith(category)
    assert BFCLEnv.reward_description


def test_calls_from_message():
    msg = {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
            {"type": "function", "function": {"name": "b", "arguments": {"y": [2]}}},
            {"type": "function", "function": {"name": "c", "arguments": "not json"}},
        ],
    }
    assert calls_from_message(msg) == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {"y": [2]}},
        {"name": "c", "arguments": "not json"},
    ]
    assert calls_from_message({"role": "assistant", "content": "hi"}) == []


def test_badly_shaped_actions_are_refused_or_read_leniently():
    import gymnasium

    from relax_agent.envs.bfcl.env import calls_from_message
    from relax_agent.errors import EnvError

    env = gymnasium.make("relax/BFCL-simple-v0")
    env.reset(seed=0)
    with pytest.raises(EnvError, match="must be a list"):
        env.step({"role": "assistant", "content": "", "tool_calls": "junk"})
    env.reset(seed=0)
    with pytest.raises(EnvError, match="role 'user'"):
        env.step({"role": "user", "content": "hi"})
    flat = {"role": "assistant", "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}]}
    assert calls_from_message(flat) == [{"name": "f", "arguments": {"a": 1}}]
