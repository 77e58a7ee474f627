"""relax-agent: asynchronous, service-oriented RL post-training for agentic, tool-using models."""

from relax_agent.config import RelaxConfig, load_config
from relax_agent.errors import ConfigError, RelaxError

__version__ = "0.1.0"

__all__ = ["ConfigError", "RelaxConfig", "RelaxError", "__version__", "load_config"]
