"""An alarm for a jump in the rollout-vs-trainer log-prob mismatch.

Trainer and rollout engine compute the same policy, so ``mismatch/abs_logprob_diff_mean`` (see
:func:`~relax_agent.train.algorithms.mismatch_metrics`) stays at the level the two kernels and dtypes
give (about 1e-6 for an fp32 HF engine beside an fp32 trainer, 1e-2 for bf16 vLLM). A jump far above
the run's own level means the engines sample from other weights than the trainer's (a partial or
corrupted weight load, a checkpoint of another model, a template mismatch): training on it goes on
but optimises a policy nobody sampled from. :class:`MismatchWatch` says so, once per jump.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any

from relax_agent.control.schedule import STALENESS_MAX
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MEAN

ALARM = "mismatch/alarm"
"""Metric: 1.0 on a step whose mismatch jumped (see :class:`MismatchWatch`), else 0.0."""


class MismatchWatch:
    """A step hook (``runtime.step_hooks``) that flags a step whose mean |log-prob difference| is
    over ``jump`` times the median of the previous ``window`` steps' and over ``floor`` (a jump
    from 2e-6 to 5e-5 is noise; from 2e-6 to 0.04 is not). The first step only sets the level. A
    step that trained a stale sample (``async/staleness_max`` > 0) is skipped: its difference also
    holds the policy's own change since the sample was drawn.

    Args:
        jump: how many times the run's own level counts as a jump.
        floor: values at or under this never alarm.
        window: steps the level is the median of.

    Raises:
        ValueError: ``jump`` <= 1, ``floor`` < 0 or ``window`` < 1.
    """

    def __init__(self, jump: float = 10.0, floor: float = 1e-3, window: int = 20) -> None:
        if jump <= 1.0 or floor < 0.0 or window < 1:
            raise ValueError(f"MismatchWatch(jump={jump}, floor={floor}, window={window}): expected jump > 1, "
                             "floor >= 0 and window >= 1")
        self.jump, self.floor = jump, floor
        self.history: deque[float] = deque(maxlen=window)

    def observe(self, row: Mapping[str, Any]) -> dict[str, float]:
        """``{ALARM: 1.0}`` (and a ``RuntimeWarning``) when ``row``'s mismatch jumped, ``{ALARM: 0.0}``
        otherwise; ``{}`` for a row with no mismatch (no update this step) or a stale sample."""
        value = row.get(MISMATCH_ABS_DIFF_MEAN)
        if value is None or not math.isfinite(value) or row.get(STALENESS_MAX, 0) > 0:
            return {}
        level = statistics.median(self.history) if self.history else None
        self.history.append(value)
        if level is None or value <= self.floor or value <= self.jump * level:
            return {ALARM: 0.0}
        warnings.warn(
            f"the rollout and trainer log-probs of this step differ by {value:.3g} on average "
            f"({MISMATCH_ABS_DIFF_MEAN}), {value / max(level, 1e-300):.0f}x this run's level of {level:.3g}: the "
            "engines may be sampling from other weights than the trainer's (a failed or partial weight load, another "
            "checkpoint, another chat template); check the weight sync lines and `relax-agent replay` this step",
            RuntimeWarning, stacklevel=2)
        return {ALARM: 1.0}
