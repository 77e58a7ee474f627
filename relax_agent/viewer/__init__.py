"""``relax-agent view RUN_DIR``: browse a run (finished or in progress) in a local web page.

Steps -> groups -> episodes (reward, status, stop reason, trained/dropped/filtered flags, policy
versions), each episode's turns, two episodes of a group side by side, filters, the run's curves
and the held-out evaluation samples with their verdicts. Reads only the files a run writes.
"""

from relax_agent.viewer.app import ViewerConfig, ViewerServer, build, build_app
from relax_agent.viewer.data import EpisodeFilter, RunReader, read_jsonl

__all__ = ["EpisodeFilter", "RunReader", "ViewerConfig", "ViewerServer", "build", "build_app", "read_jsonl"]
