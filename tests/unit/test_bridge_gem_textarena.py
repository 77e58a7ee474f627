"""The GEM and TextArena bridges (relax/GEM-v0, relax/TextArena-v0): the episode reward equals what the
package's own env gives for the same seed and moves, a scripted binary search wins Guess the Number,
the game's randomness stays per game (never the process's), demonstrations replay to a win, and
unsupported ids, multi-player games and a missing package are refused with a clear ConfigError."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import relax_agent.envs as envs
from relax_agent.envs.bridges.text_games import HELDOUT_SEED_BASE
from relax_agent.errors import ConfigError, DataError, EnvError

gem = pytest.importorskip("gem")
ta = pytest.importorskip("textarena")

REPO = Path(__file__).resolve().parents[2]
BINARY = "binary search"
FORMAT = {"gem": "\\boxed{%d}", "textarena": "[%d]"}


@pytest.fixture(autouse=True)
def _keep_process_rng():
    """The direct plays below reseed the process's random state (the packages do): put it back."""
    state = random.getstate(), np.random.get_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])


class BinarySearch:
    """The scripted Guess-the-Number policy: bounds from the prompt, then the hints."""

    def __init__(self, scheme: str):
        self.fmt, self.low, self.high, self.guess = FORMAT[scheme], None, None, None

    def __call__(self, text: str) -> str:
        if self.low is None:
            low, high = re.search(r"between (\d+) and (\d+)", text).groups()
            self.low, self.high = int(low), int(high)
        else:
            hint = re.findall(r"\b(higher|lower)\b", text)[-1]
            self.low, self.high = (self.guess + 1, self.high) if hint == "higher" else (self.low, self.guess - 1)
        self.guess = (self.low + self.high) // 2
        return self.fmt % self.guess


def task(game: str, seed: int) -> dict:
    return {"id": f"t-{seed}", "game": game, "seed": seed}


def play_bridge(scheme: str, game: str, seed: int, actions) -> dict:
    """Play the bridge env; ``actions`` a list of reply texts or a policy (text -> reply)."""
    env = envs.make(f"{scheme}:{game}")
    try:
        messages, info = env.reset(seed=0, options={"task": task(game, seed)})
        out = {"opening": messages[0]["content"], "actions": [], "texts": [], "rewards": [], "flags": [], "infos": []}
        text = messages[0]["content"]
        for i in range(64):
            if callable(actions):
                action = actions(text)
            elif i < len(actions):
                action = actions[i]
            else:
                break
            obs, reward, terminated, truncated, info = env.step({"role": "assistant", "content": action, "tool_calls": []})
            text = obs[0]["content"]
            out["actions"].append(action)
            out["texts"].append(text)
            out["rewards"].append(reward)
            out["flags"].append((terminated, truncated))
            out["infos"].append(info)
            if terminated or truncated:
                break
        return out
    finally:
        env.close()


def play_gem_directly(game: str, seed: int, actions: list[str]) -> dict:
    env = gem.make(game)
    obs, _ = env.reset(seed=seed)
    out = {"opening": obs, "texts": [], "rewards": [], "flags": []}
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out["texts"].append(obs)
        out["rewards"].append(float(reward))
        out["flags"].append((bool(terminated), bool(truncated)))
        if terminated or truncated:
            break
    return out


def _innermost(env):
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _said(base) -> list[str]:
    return [m for sender, m, kind in base.get_observation()[1] if not (sender == 0 and kind == ta.ObservationType.PLAYER_ACTION)]


def play_textarena_directly(game: str, seed: int, actions: list[str]) -> dict:
    env = ta.make(game)
    env.reset(num_players=1, seed=seed)
    base = _innermost(env)
    out = {"opening": "\n".join(_said(base)), "said": [], "reward": None, "steps": 0, "done": False}
    for action in actions:
        done, _ = env.step(action)
        out["steps"] += 1
        out["said"].append(_said(base))
        if done:
            rewards, _ = env.close()
            out["reward"], out["done"] = float(rewards[0]), True
            break
    return out


HANOI_3 = ["\\boxed{A C}", "\\boxed{A B}", "\\boxed{C B}", "\\boxed{A C}", "\\boxed{B A}", "\\boxed{B C}", "\\boxed{A C}"]
GEM_CASES = [
    ("game:GuessTheNumber-v0-hard", 3, BINARY),                                        # a win over several turns
    ("game:GuessTheNumber-v0-hard", 5, [f"\\boxed{{{n}}}" for n in range(1, 8)]),      # lost: target 40, 7 turns
    ("game:GuessTheNumber-v0-hard", 0, ["\\boxed{99}", "\\boxed{20}", "\\boxed{20}", "no guess"]),  # -0.1 at the end
    ("game:GuessTheNumber-v0-random", 11, BINARY),
    ("game:GuessTheNumber-v0-easy", 2, ["I pick \\boxed{1} then \\boxed{4}"]),         # the last \boxed counts: a win
    ("game:TowerofHanoi-v0-easy", 0, HANOI_3),                                         # solved in 7 moves
    ("game:TowerofHanoi-v0-easy", 0, ["\\boxed{A C}", "\\boxed{A C}", "\\boxed{X Y}"]),
    ("game:Mastermind-v0-easy", 5, ["\\boxed{1 2}", "\\boxed{3 4}", "\\boxed{5 6}", "\\boxed{2 1}", "\\boxed{4 3}"]),
    ("game:Game2048-v0-easy", 2, ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 4),
    ("game:Minesweeper-v0-easy", 1, ["\\boxed{reveal 2 2}", "\\boxed{reveal 0 0}", "\\boxed{flag 4 4}", "\\boxed{reveal 4 0}"]),
]


@pytest.mark.parametrize("game, seed, actions", GEM_CASES)
def test_gem_rewards_equal_gems_own_for_the_same_moves(game, seed, actions):
    bridged = play_bridge("gem", game, seed, BinarySearch("gem") if actions == BINARY else actions)
    direct = play_gem_directly(game, seed, bridged["actions"])
    assert bridged["rewards"] == direct["rewards"] and bridged["flags"] == direct["flags"]
    assert sum(bridged["rewards"]) == pytest.approx(sum(direct["rewards"]))
    assert bridged["opening"].startswith(direct["opening"])
    assert all(b.startswith(d) for b, d in zip(bridged["texts"], direct["texts"], strict=True))
    ended = any(direct["flags"][-1])
    assert bridged["infos"][-1]["correct"] == float(ended and sum(direct["rewards"]) >= 1.0)


def test_the_gem_cases_cover_a_win_a_loss_and_a_format_error():
    outcomes = {(g, s): sum(play_bridge("gem", g, s, BinarySearch("gem") if a == BINARY else a)["rewards"])
                for g, s, a in GEM_CASES[:3] + GEM_CASES[5:6]}
    assert outcomes[("game:GuessTheNumber-v0-hard", 3)] == 1.0
    assert outcomes[("game:GuessTheNumber-v0-hard", 5)] == pytest.approx(1 - (40 - 7) / 49)  # GEM's partial credit
    assert outcomes[("game:GuessTheNumber-v0-hard", 0)] == pytest.approx(-0.1)
    assert outcomes[("game:TowerofHanoi-v0-easy", 0)] == 1.0


def test_gem_reasoning_gym_ids_score_like_gem():
    direct_env = gem.make("rg:leg_counting")
    direct_env.reset(seed=7)
    answer = direct_env.data["answer"]
    for reply, reward in ((f"\\boxed{{{answer}}}", 1.0), ("\\boxed{-1}", 0.0)):
        bridged = play_bridge("gem", "rg:leg_counting", 7, [reply])
        assert bridged["rewards"] == play_gem_directly("rg:leg_counting", 7, [reply])["rewards"] == [reward]
        assert bridged["flags"] == [(True, True)]


TA_CASES = [
    ("GuessTheNumber-v0", 3, BINARY),                                                  # a win: reward 1
    ("GuessTheNumber-v0", 5, [f"[{n}]" for n in range(1, 11)]),                        # not over yet: no reward
    ("GuessTheNumber-v0", 5, [f"[{n}]" for n in range(1, 12)]),                        # lost at the turn limit
    ("GuessTheNumber-v0", 0, ["no guess", "still none"]),                              # two invalid moves in a row
    ("GuessTheNumber-v0", 0, ["[4]", "x", "[30]", "[4]"]),                             # invalid after a hint
    ("GuessTheNumber-v0", 1, ["5"]),                                                   # ActionFormattingWrapper: [5] wins
    ("GuessTheNumber-v0-raw", 1, ["5", "8"]),                                          # no wrapper: both invalid
    ("GuessTheNumber-v0-hardcore", 9, BINARY),
    ("TowerOfHanoi-v0", 0, ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]),
    ("Mastermind-v0", 2, ["[1 2 3 4]", "[2 3 4 5]", "[3 4 5 6]", "[1 1 1 1]"] * 3),
    ("2048-v0-ultra-easy", 4, ["[up]", "[left]", "[down]", "[right]"] * 4),
    ("ThreeCardMonte-v0", 6, ["[1]"]),
]


@pytest.mark.parametrize("game, seed, actions", TA_CASES)
def test_textarena_rewards_equal_textarenas_own_for_the_same_moves(game, seed, actions):
    bridged = play_bridge("textarena", game, seed, BinarySearch("textarena") if actions == BINARY else actions)
    direct = play_textarena_directly(game, seed, bridged["actions"])
    assert len(bridged["rewards"]) == direct["steps"]
    assert bridged["rewards"][:-1] == [0.0] * (direct["steps"] - 1)  # TextArena rewards only at the end
    assert sum(bridged["rewards"]) == pytest.approx(direct["reward"] if direct["done"] else 0.0)
    assert bridged["flags"][-1] == (direct["done"], False)
    assert bridged["opening"] == direct["opening"]
    for text, said in zip(bridged["texts"], direct["said"], strict=True):
        assert text.startswith("\n".join(said))


def test_the_textarena_cases_cover_a_win_a_loss_and_invalid_moves():
    def reward(game, seed, actions):
        return sum(play_bridge("textarena", game, seed, actions)["rewards"])

    assert reward("GuessTheNumber-v0", 3, BinarySearch("textarena")) == 1.0
    assert reward("GuessTheNumber-v0", 5, [f"[{n}]" for n in range(1, 11)]) == 0.0  # TextArena checks the limit
    assert reward("GuessTheNumber-v0", 5, [f"[{n}]" for n in range(1, 12)]) == pytest.approx(1 - (20 - 11) / 19)  # on guess 11
    assert reward("GuessTheNumber-v0", 0, ["no guess", "still none"]) == 0.0
    assert reward("GuessTheNumber-v0", 1, ["5"]) == 1.0 and reward("GuessTheNumber-v0-raw", 1, ["5", "8"]) == 0.0


@pytest.mark.parametrize("scheme, game", [("gem", "game:GuessTheNumber-v0-hard"), ("textarena", "GuessTheNumber-v0")])
def test_binary_search_wins_every_heldout_instance_and_garbage_never_does(scheme, game):
    env = envs.make(f"{scheme}:{game}", num_heldout=20)
    heldout = env.unwrapped.tasks("heldout")
    env.close()
    scripted = [play_bridge(scheme, game, t["seed"], BinarySearch(scheme)) for t in heldout]
    assert [sum(p["rewards"]) for p in scripted] == [1.0] * 20
    assert all(p["infos"][-1]["correct"] == 1.0 for p in scripted)
    turns = [len(p["actions"]) for p in scripted]
    assert max(turns) >= 3 and sum(turns) / len(turns) >= 3  # a multi-turn game
    garbage = [play_bridge(scheme, game, t["seed"], lambda _: "I am not sure what to say.") for t in heldout]
    assert {sum(p["rewards"]) for p in garbage} == ({-0.1} if scheme == "gem" else {0.0})
    assert all(p["infos"][-1]["correct"] == 0.0 for p in garbage)


def test_games_draw_from_their_own_random_stream_not_the_processes():
    actions = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 3
    alone = [play_gem_directly("game:Game2048-v0-easy", s, actions)["texts"] for s in (1, 2)]
    random.seed(123)
    before = random.getstate(), np.random.get_state()[1].copy()
    a, b = envs.make("gem:game:Game2048-v0-easy"), envs.make("gem:game:Game2048-v0-easy")
    a.reset(options={"task": task("game:Game2048-v0-easy", 1)})
    b.reset(options={"task": task("game:Game2048-v0-easy", 2)})
    texts: list[list[str]] = [[], []]
    for action in actions:  # interleaved, and some from another thread: tiles still spawn as in a lone game
        texts[0].append(a.step({"role": "assistant", "content": action})[0][0]["content"])
        worker = threading.Thread(target=lambda act=action: texts[1].append(b.step({"role": "assistant", "content": act})[0][0]["content"]))
        worker.start()
        worker.join(timeout=60)
    a.close()
    b.close()
    for bridged, direct in zip(texts, alone, strict=True):
        assert len(bridged) == len(direct) and all(x.startswith(y) for x, y in zip(bridged, direct, strict=True))
    assert texts[0] != texts[1]
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()


def test_tasks_are_seeded_instances_in_disjoint_deterministic_splits():
    env = envs.make("gem:game:GuessTheNumber-v0-hard", num_tasks=30, num_heldout=5)
    inner = env.unwrapped
    train, heldout = inner.tasks("train"), inner.tasks("heldout")
    assert [t["seed"] for t in train] == list(range(30))
    assert [t["seed"] for t in heldout] == list(range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + 5))
    assert train[17] == {"id": "gem-GuessTheNumber-v0-hard-s17", "game": "game:GuessTheNumber-v0-hard", "seed": 17}
    assert inner.tasks("train") == train and not {t["id"] for t in train} & {t["id"] for t in heldout}
    first = env.reset(options={"task": train[4]})[0]
    assert env.reset(seed=7, options={"task": train[4]})[0] == first  # the task's seed decides, not reset's
    with pytest.raises(DataError, match="is for game"):
        env.reset(options={"task": task("game:GuessTheNumber-v0-easy", 1)})
    with pytest.raises(DataError, match="unknown split"):
        inner.tasks("test")
    env.close()
    ta_env = envs.make("textarena:GuessTheNumber-v0")
    assert ta_env.unwrapped.tasks("train")[0]["id"] == "textarena-GuessTheNumber-v0-s0"
    assert len(ta_env.unwrapped.tasks("train")) == 1000 and len(ta_env.unwrapped.tasks("heldout")) == 200
    ta_env.close()


def test_the_secret_follows_the_task_seed():
    def target(seed):
        env = envs.make("gem:game:GuessTheNumber-v0-hard")
        env.reset(seed=99, options={"task": task("game:GuessTheNumber-v0-hard", seed)})
        guesses = [env.step({"role": "assistant", "content": f"\\boxed{{{n}}}"}) for n in (25,)]
        env.close()
        return guesses[0][0][0]["content"]

    assert target(5) == target(5)
    assert "lower than 25" in target(2) and "higher than 25" in target(5)  # GEM's targets: seed 2 -> 4, seed 5 -> 40


@pytest.mark.parametrize("scheme, game", [("gem", "game:GuessTheNumber-v0-easy"), ("textarena", "GuessTheNumber-v0")])
def test_close_ends_the_game_and_steps_after_it_are_refused(scheme, game, monkeypatch):
    closed = []
    if scheme == "textarena":
        original = ta.Env.close
        monkeypatch.setattr(ta.Env, "close", lambda self: closed.append(self) or original(self))
    env = envs.make(f"{scheme}:{game}")
    with pytest.raises(EnvError, match="before reset"):
        env.unwrapped.step({"role": "assistant", "content": "[1]"})
    env.reset(seed=0)
    env.step({"role": "assistant", "content": FORMAT[scheme] % 2})
    env.close()
    env.close()  # idempotent
    assert len(closed) == (1 if scheme == "textarena" else 0)
    with pytest.raises(EnvError, match="reset first"):
        env.unwrapped.step({"role": "assistant", "content": "[1]"})


def test_demonstrations_replay_to_a_win_and_other_games_have_none():
    for scheme, game in (("gem", "game:GuessTheNumber-v0-hard"), ("textarena", "GuessTheNumber-v0")):
        env = envs.make(f"{scheme}:{game}")
        for t in env.unwrapped.tasks("train")[:5]:
            demo = env.unwrapped.demonstration(t)
            assert [m["role"] for m in demo] == ["assistant", "user"] * (len(demo) // 2) + ["assistant"]
            env.reset(options={"task": t})
            for reply, expected in zip(demo[::2], [*demo[1::2], None], strict=True):
                obs, reward, terminated, _, _ = env.step(reply)
                if expected is not None:
                    assert obs == [expected] and not terminated
            assert terminated and reward == 1.0
        env.close()
    hanoi = envs.make("gem:game:TowerofHanoi-v0-easy")
    assert hanoi.unwrapped.demonstration(hanoi.unwrapped.tasks("train")[0]) is None
    hanoi.close()


def test_demonstrations_render_as_multi_turn_warmup_rows(tiny_model_dir):
    import gymnasium

    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.demonstrations import demonstration_fields
    from relax_agent.rollout.parsers import build_parser

    def make():
        return gymnasium.make("relax/GEM-v0", game="game:GuessTheNumber-v0-hard")

    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    env = make()
    tasks = env.unwrapped.tasks("train")[:3]
    demos = [env.unwrapped.demonstration(t) for t in tasks]
    env.close()
    rows = demonstration_fields(make, ChatRenderer(tokenizer), build_parser("hermes_strict"), tasks, seed=0)
    assert rows["task_id"] == [t["id"] for t in tasks]
    for ids, mask, demo in zip(rows["token_ids"], rows["loss_mask"], demos, strict=True):
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
        assert trained == "".join(m["content"] for m in demo if m["role"] == "assistant")  # only the guesses train
        hints = [m["content"] for m in demo if m["role"] == "user"]
        assert all(h in tokenizer.decode(ids) for h in hints)  # the hints are in the context, outside the loss


def test_unknown_ids_multiplayer_games_and_online_gem_envs_are_refused():
    with pytest.raises(ConfigError, match="did you mean 'game:GuessTheNumber-v0-hard'"):
        envs.make("gem:game:GuessTheNumber-v0")  # GEM 0.1 registers only -easy, -hard, -random
    with pytest.raises(ConfigError, match="offline ids"):
        envs.make("gem:math:GSM8K")
    with pytest.raises(ConfigError, match="multi-player TextArena game.*opponent in every other seat"):
        envs.make("textarena:TicTacToe-v0")
    with pytest.raises(ConfigError, match="did you mean 'GuessTheNumber-v0'"):
        envs.make("textarena:GuessTheNumbr-v0")
    with pytest.raises(ConfigError, match="num_tasks=0"):
        envs.make("textarena:GuessTheNumber-v0", num_tasks=0)


def test_available_lists_the_games_each_package_offers():
    from relax_agent.envs.bridges import offered

    gem_ids, ta_ids = offered("gem"), offered("textarena")
    assert {"game:GuessTheNumber-v0-hard", "game:Sokoban-v0-easy", "rg:leg_counting"} <= set(gem_ids)
    assert not any(i.startswith(("math:", "code:", "qa:", "eval:")) for i in gem_ids)
    assert {"GuessTheNumber-v0", "GuessTheNumber-v0-raw", "TowerOfHanoi-v0", "2048-v0"} <= set(ta_ids)
    assert not {"TicTacToe-v0", "Chess-v0", "Poker-v0"} & set(ta_ids)


@pytest.mark.parametrize("scheme, module", [("gem", "gem"), ("textarena", "textarena")])
def test_a_missing_package_names_its_extra(scheme, module, monkeypatch):
    from relax_agent.envs.bridges import offered

    monkeypatch.setitem(sys.modules, module, None)
    game = "game:GuessTheNumber-v0-hard" if scheme == "gem" else "GuessTheNumber-v0"
    with pytest.raises(ConfigError, match=rf"pip install 'relax-agent\[{scheme}\]'"):
        envs.make(f"{scheme}:{game}")
    with pytest.raises(ConfigError, match=rf"relax-agent\[{scheme}\]"):
        offered(scheme)


def test_importing_gem_through_the_bridge_leaves_the_root_logger_alone():
    code = ("import logging; from relax_agent.envs.bridges.gem import available; available(); "
            "root = logging.getLogger(); print(len(root.handlers), root.level)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", str(30)]  # no handler added, WARNING as Python starts it


def _scripted_engine(tokenizer, fmt: str, halve: bool = True):
    """A FakeEngine whose reply is computed from the whole prompt: binary search over the hints so far
    (``halve``), or always the lowest number."""
    from relax_agent.rollout.engines.fake import FakeEngine

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        low, high = map(int, re.search(r"between (\d+) and (\d+)", text).groups())
        guess = (low + high) // 2 if halve else low
        for hint in re.findall(r"target number is (higher|lower)", text):
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
            guess = (low + high) // 2 if halve else low
        return tokenizer(fmt % guess, add_special_tokens=False)["input_ids"] + [end]

    return FakeEngine(reply, stop_token_ids=(end,))


@pytest.mark.parametrize("scheme, game, max_turns", [("gem", "game:GuessTheNumber-v0-hard", 7),
                                                     ("textarena", "GuessTheNumber-v0", 11)])
def test_the_rollout_driver_sums_the_games_rewards_over_a_multi_turn_episode(scheme, game, max_turns, tiny_model_dir):
    """Through the real rollout driver (renderer, parser, observation deltas): a binary-search policy wins
    in several turns, an always-guess-the-lowest one loses; the trajectory's reward is the game's."""
    import asyncio

    from transformers import AutoTokenizer

    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.driver import EpisodeSpec
    from relax_agent.rollout.engines.base import SamplingParams
    from relax_agent.rollout.env_driver import run_episode
    from relax_agent.rollout.parsers import build_parser

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for seed, halve in ((3, True), (5, True), (5, False)):
        t = task(game, seed)
        spec = EpisodeSpec(f"s{seed}", "g", t["id"], t, seed=0, max_turns=max_turns, max_total_tokens=4096)
        traj = asyncio.run(run_episode(envs.make(f"{scheme}:{game}"), spec, _scripted_engine(tokenizer, FORMAT[scheme], halve),
                                       ChatRenderer(tokenizer), build_parser("hermes_strict"), SamplingParams(16)))
        assert traj.error is None and str(traj.stop_reason) in ("terminated", "truncated"), (traj.error, traj.stop_reason)
        moves = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        if scheme == "gem":
            expected = sum(play_gem_directly(game, seed, moves)["rewards"])
        else:
            direct = play_textarena_directly(game, seed, moves)
            assert direct["done"]
            expected = direct["reward"]
        assert traj.reward == pytest.approx(expected)
        assert (traj.reward == 1.0) == halve and len(moves) >= 3
        assert traj.metrics["correct"] == float(halve) and traj.metrics["turn"] == len(moves)
