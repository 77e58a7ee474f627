"""The trainer as a Ray actor (:mod:`.actor`), and the trainer service that drives it and restarts it
from the last checkpoint (:mod:`.service`)."""

from __future__ import annotations

from relax_agent.runtime.ray_trainer.actor import TrainerActor
from relax_agent.runtime.ray_trainer.service import RayTrainerService, TrainerSupervision

__all__ = ["RayTrainerService", "TrainerActor", "TrainerSupervision"]
