"""Every config key, its type and its default are pinned in ``tests/data/config_keys.txt``.

A change to the config tree (a key added, removed, renamed, retyped or given another default)
fails here with the diff; review it, then regenerate the file with
``python -m relax_agent.configkeys --write tests/data/config_keys.txt``.
"""

import difflib
from pathlib import Path

import pytest

from relax_agent.config import RelaxConfig, _known_keys
from relax_agent.configkeys import WRITE_COMMAND, config_keys_text, iter_config_keys, main

SNAPSHOT = Path(__file__).parents[1] / "data" / "config_keys.txt"


def snapshot_diff(pinned: str, live: str) -> str:
    """A unified diff from the pinned listing to the live one ('' when they agree)."""
    return "".join(difflib.unified_diff(pinned.splitlines(keepends=True), live.splitlines(keepends=True),
                                        fromfile="tests/data/config_keys.txt", tofile="live config tree"))


def test_config_keys_match_the_snapshot():
    diff = snapshot_diff(SNAPSHOT.read_text(), config_keys_text())
    if diff:
        pytest.fail(f"the config keys changed; review the diff, then regenerate the snapshot with\n"
                    f"  {WRITE_COMMAND}\n\n{diff}", pytrace=False)


def test_the_snapshot_pins_real_keys_with_their_defaults():
    lines = SNAPSHOT.read_text().splitlines()
    assert len(lines) > 100
    for line in ("rollout.max_new_tokens  int  128", "rollout.group_size  int  8", "trainer.lr  float  1e-05",
                 "runtime.max_rollout_replicas  int  64", "eval.seeds  list[int]  [0, 1, 2]",
                 "reward.components  list[RewardComponentConfig]  [RewardComponentConfig()]",
                 "reward.components[].source  Literal['env', 'local', 'remote']  'env'"):
        assert line in lines


def test_the_listing_names_the_keys_the_loader_knows():
    listed = [k.key for k in iter_config_keys() if "[]" not in k.key]
    assert listed == _known_keys(RelaxConfig)
    assert RelaxConfig().rollout.max_new_tokens == 128


def test_a_changed_default_fails_with_a_diff_naming_the_key():
    live = config_keys_text()
    pinned = live.replace("rollout.max_new_tokens  int  128\n", "rollout.max_new_tokens  int  64\n")
    diff = snapshot_diff(pinned, live)
    assert "-rollout.max_new_tokens  int  64\n" in diff and "+rollout.max_new_tokens  int  128\n" in diff


def test_write_regenerates_the_snapshot(tmp_path, capsys):
    out = tmp_path / "keys.txt"
    assert main(["--write", str(out)]) == 0
    assert out.read_text() == config_keys_text()
    assert f"wrote {len(out.read_text().splitlines())} keys" in capsys.readouterr().out
