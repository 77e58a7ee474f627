"""relax_agent.reward_services: rewards as functions, HTTP services, or weighted combinations.

Wire a reward from config::

    from relax_agent.reward_services import RewardConfig, build_reward, check_reward
    reward = build_reward(RewardConfig(source="remote", url="http://127.0.0.1:8001", token_env="REWARD_TOKEN"))
    await check_reward(reward)                 # wrong URL/token fails here, not mid-run
    results = await reward.score(items)        # one RewardResult per RewardItem, in order
    rewards, mask = rewards_and_mask(results)  # failed items: nan reward, mask False

Serve a function: ``relax-agent serve-reward module:function --port 8001``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> submodule that defines it. Loaded on first use, so that importing the
# config (``relax_agent.config`` needs ``RewardConfig``) does not pull FastAPI and uvicorn.
_EXPORTS = {
    "client": ("RetryPolicy", "RewardClient"),
    "combine": ("CombinedReward", "Component", "check_reward"),
    "config": ("RewardComponentConfig", "RewardConfig", "build_reward"),
    "env_reward": ("ENV_REWARD_KEY", "EnvReward"),
    "fake": ("FakeReward",),
    "local": ("LocalReward", "load_target"),
    "protocol": ("API_VERSION", "HEALTH_PATH", "REWARD_PATH", "ChecksAtStart", "ReportsHealth", "RewardFunction", "RewardItem", "RewardRequest",
                 "RewardResponse", "RewardResult", "RewardStatus", "reward_metrics", "rewards_and_mask"),
    "server": ("create_app",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from relax_agent.reward_services.client import RetryPolicy, RewardClient
    from relax_agent.reward_services.combine import CombinedReward, Component, check_reward
    from relax_agent.reward_services.config import RewardComponentConfig, RewardConfig, build_reward
    from relax_agent.reward_services.env_reward import ENV_REWARD_KEY, EnvReward
    from relax_agent.reward_services.fake import FakeReward
    from relax_agent.reward_services.local import LocalReward, load_target
    from relax_agent.reward_services.protocol import (
        API_VERSION,
        HEALTH_PATH,
        REWARD_PATH,
        ChecksAtStart,
        ReportsHealth,
        RewardFunction,
        RewardItem,
        RewardRequest,
        RewardResponse,
        RewardResult,
        RewardStatus,
        reward_metrics,
        rewards_and_mask,
    )
    from relax_agent.reward_services.server import create_app


def __getattr__(name: str) -> Any:
    """Import the submodule that defines public ``name`` on first access."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "API_VERSION",
    "ChecksAtStart",
    "CombinedReward",
    "Component",
    "ENV_REWARD_KEY",
    "EnvReward",
    "FakeReward",
    "HEALTH_PATH",
    "LocalReward",
    "REWARD_PATH",
    "ReportsHealth",
    "RetryPolicy",
    "RewardClient",
    "RewardComponentConfig",
    "RewardConfig",
    "RewardFunction",
    "RewardItem",
    "RewardRequest",
    "RewardResponse",
    "RewardResult",
    "RewardStatus",
    "build_reward",
    "check_reward",
    "create_app",
    "load_target",
    "reward_metrics",
    "rewards_and_mask",
]
