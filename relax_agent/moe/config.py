"""MoE section of the run config: routing replay (R3) on or off.

YAML::

    moe:
      routing_replay: rollout   # record the rollout's experts, force them in training

Kept free of torch so that loading a config stays cheap.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from relax_agent.configbase import Section


class MoEConfig(Section):
    """Mixture-of-experts policies: rollout routing replay (R3, arXiv 2510.11370)."""

    routing_replay: Literal["off", "rollout"] = "off"
    """"off": the trainer routes every token itself. "rollout": the rollout engine records
    the top-k experts of every policy token in every MoE layer, they travel with the
    trajectory, and the trainer forces its routers to them (the gate weights are still
    computed from the trainer's own router logits, so the router keeps its gradient).
    Ignored, with a warning, for a dense policy."""

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False.
        return "off" if value is False else value

    @property
    def replay(self) -> bool:
        """True when the engine records routes and the trainer replays them."""
        return self.routing_replay == "rollout"
