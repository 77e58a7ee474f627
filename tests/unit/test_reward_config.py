"""RewardConfig: shorthand and components, validation, build_reward."""

import asyncio

import httpx
import pytest
from pydantic import ValidationError

from relax_agent.errors import ConfigError
from relax_agent.reward_services import (
    CombinedReward,
    EnvReward,
    LocalReward,
    RewardClient,
    RewardConfig,
    RewardItem,
    build_reward,
    check_reward,
    create_app,
)


def test_default_is_the_env_reward():
    assert isinstance(build_reward(RewardConfig()), EnvReward)


def test_shorthand_is_one_component():
    cfg = RewardConfig.model_validate({"source": "remote", "url": "http://127.0.0.1:8001", "request_timeout_s": 5})
    assert len(cfg.components) == 1 and cfg.components[0].url == "http://127.0.0.1:8001"
    reward = build_reward(cfg)
    assert isinstance(reward, RewardClient) and reward.base_url == "http://127.0.0.1:8001"
    assert reward._timeout.read == 5.0 and reward._timeout.connect == 5.0


@pytest.mark.parametrize("data, message", [
    ({"source": "local"}, "source: local needs function"),
    ({"source": "remote"}, "source: remote needs url"),
    ({"source": "remote", "url": "127.0.0.1:8001"}, "must start with http"),
    ({"source": "env", "url": "http://x"}, r"source: env does not take \['url'\]"),
    ({"source": "sandbox"}, "Input should be 'env', 'local' or 'remote'"),
    ({"source": "env", "wieght": 2}, "wieght"),
    ({"components": [{"source": "env"}, {"source": "env"}]}, r"names \['env'\] repeat"),
    ({"components": []}, "at least one component"),
])
def test_bad_configs_name_the_key(data, message):
    with pytest.raises(ValidationError, match=message):
        RewardConfig.model_validate(data)


def test_ignored_keys_warn(caplog):
    RewardConfig.model_validate({"source": "local", "function": "m:f", "max_attempts": 3})
    assert "['max_attempts'] ignored for source: local" in caplog.text
    RewardConfig.model_validate({"source": "remote", "url": "http://x", "timeout_s": 3})
    assert "['timeout_s'] ignored for source: remote" in caplog.text


def test_missing_token_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    cfg = RewardConfig(source="remote", url="http://127.0.0.1:1", token_env="NO_SUCH_TOKEN_VAR")
    with pytest.raises(ConfigError, match="'NO_SUCH_TOKEN_VAR' is unset"):
        build_reward(cfg)


def test_combined_local_env_and_remote(monkeypatch, tmp_path):
    monkeypatch.setenv("TEST_REWARD_TOKEN", "tok")
    fn_file = tmp_path / "r.py"
    fn_file.write_text("def length(response):\n    return len(response)\n")
    app = create_app(LocalReward(lambda id: 10.0), token="tok")
    cfg = RewardConfig.model_validate({"components": [
        {"source": "env", "weight": 1.0},
        {"source": "local", "function": f"{fn_file}:length", "weight": 0.5},
        {"source": "remote", "url": "http://svc", "token_env": "TEST_REWARD_TOKEN", "weight": 0.1, "name": "judge"},
        {"source": "remote", "url": "http://svc", "token_env": "TEST_REWARD_TOKEN", "weight": 0.2, "name": "judge2"},
    ]})
    reward = build_reward(cfg, http_transport=httpx.ASGITransport(app=app))
    assert isinstance(reward, CombinedReward)
    assert reward.components[2].reward is reward.components[3].reward  # one client per service
    assert [c.name for c in reward.components] == ["env", "length", "judge", "judge2"]

    async def main():
        await check_reward(reward)
        out = await reward.score([RewardItem(id="a", response="abcd", metadata={"env_reward": 1.0})])
        await reward.aclose()
        return out

    out = asyncio.run(main())
    assert out[0].reward == pytest.approx(1.0 + 0.5 * 4 + 0.1 * 10 + 0.2 * 10)
