"""Control plane: the one loop (rollout -> bus -> trainer -> weight sync) and its schedules."""

from relax_agent.control.build import build_controller
from relax_agent.control.loop import Controller
from relax_agent.control.schedule import StalenessGate
from relax_agent.control.stop import StopRequest

__all__ = ["Controller", "build_controller", "StalenessGate", "StopRequest"]
