"""The curated API of relax_agent.reward_services, and what importing it costs."""

import subprocess
import sys

import relax_agent.reward_services as rs


def test_public_names_are_pinned():
    assert sorted(rs.__all__) == sorted([
        "API_VERSION", "ChecksAtStart", "CombinedReward", "Component", "ENV_REWARD_KEY", "EnvReward", "FakeReward", "HEALTH_PATH",
        "LocalReward", "REWARD_PATH", "ReportsHealth", "RetryPolicy", "RewardClient", "RewardComponentConfig", "RewardConfig",
        "RewardFunction", "RewardItem", "RewardRequest", "RewardResponse", "RewardResult", "RewardStatus",
        "build_reward", "check_reward", "create_app", "load_target", "reward_metrics", "rewards_and_mask",
    ])
    assert all(hasattr(rs, name) for name in rs.__all__)


def test_every_reward_is_a_reward_function():
    from relax_agent.reward_services import EnvReward, FakeReward, LocalReward, RewardClient, RewardFunction

    for reward in (EnvReward(), FakeReward(), LocalReward(lambda id: 1.0), RewardClient("http://127.0.0.1:1")):
        assert isinstance(reward, RewardFunction)


def test_import_does_not_load_heavy_optional_modules():
    code = "import sys, relax_agent.reward_services; print(sorted(m for m in ('ray', 'openai', 'math_verify', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
