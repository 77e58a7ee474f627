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
    """A config section: unknown keys are errors, values are validated on assignment.

    Values are never coerced from another type (pydantic strict mode): ``"2"`` or ``true``
    for an integer, ``1`` or ``"yes"`` for a boolean, ``"1e-6"`` for a float are refused;
    an integer is accepted for a float. Floats must be finite (no ``inf`` or ``nan``).
    A field that needs a container from YAML (a list for a tuple) converts it itself.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True,
                              allow_inf_nan=False)
