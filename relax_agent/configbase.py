"""Base class for every config section: typed, documented, unknown keys refused.

Components define their own small section next to their code (``SandboxConfig`` in
``relax_agent.sandboxes``, ``EngineConfig`` in ``relax_agent.rollout``...) by subclassing
:class:`Section`; :mod:`relax_agent.config` assembles them into one tree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["fp32", "bf16", "fp16"]
"""Floating-point precision of a component's weights and compute."""


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
