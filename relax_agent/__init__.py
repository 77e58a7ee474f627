"""relax-agent: asynchronous, service-oriented RL post-training for agentic, tool-using models.

The names users import are re-exported here; heavy modules (torch, transformers) load
only when the classes that need them are used.
"""

from relax_agent.config import RelaxConfig, load_config
from relax_agent.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    EngineError,
    EnvError,
    ModelLoadError,
    RelaxError,
    RewardServiceError,
    SandboxError,
)
from relax_agent.records import RewardStatus, StopReason, Trajectory, Turn
from relax_agent.rollout.engines.base import Generation, InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import ParsedAction, ToolCallParser, build_parser, register_parser

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EngineError",
    "EnvError",
    "Generation",
    "InferenceEngine",
    "ModelLoadError",
    "ParsedAction",
    "RelaxConfig",
    "RelaxError",
    "RewardServiceError",
    "RewardStatus",
    "SamplingParams",
    "SandboxError",
    "StopReason",
    "ToolCallParser",
    "Trajectory",
    "Turn",
    "__version__",
    "build_parser",
    "load_config",
    "register_parser",
]
