"""Where the roles of a run live: the services the control loop talks to.

:mod:`relax_agent.runtime.base` declares them (:class:`RolloutService`, :class:`TrainerService`,
the :class:`Runtime` that holds a run's services); :mod:`relax_agent.runtime.local` runs them
in this process (``runtime: local``, the embedded default).
"""

from relax_agent.runtime.base import GroupDone, GroupJob, RolloutService, Runtime, TrainerService, TrainRef

__all__ = ["GroupDone", "GroupJob", "RolloutService", "Runtime", "TrainRef", "TrainerService"]
