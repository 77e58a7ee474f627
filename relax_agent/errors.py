"""The one place relax-agent's exceptions live.

Every category subclasses both :class:`RelaxError` (so callers can catch everything
relax-agent raises) and the builtin it stands for (so ``except ValueError`` still works).
All classes are plain exceptions with positional args only, so they pickle and cross
Ray process boundaries unchanged. Messages name the value or config key that fixes them.
"""

from __future__ import annotations


class RelaxError(Exception):
    """Root of every error relax-agent raises on purpose."""


class ConfigError(RelaxError, ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""


class EnvError(RelaxError, RuntimeError):
    """An environment broke its contract (bad return shape, non-finite reward, crash)."""


class EnvNotFoundError(RelaxError, LookupError):
    """An environment id is not registered."""


class ToolCallParseError(RelaxError, ValueError):
    """Model output that claims to hold a tool call could not be parsed."""


class EngineError(RelaxError, RuntimeError):
    """The inference engine failed to produce tokens."""


class ModelLoadError(RelaxError, OSError):
    """A policy model or tokenizer could not be found or loaded."""


class DataError(RelaxError, ValueError):
    """A dataset, task or data-bus row is malformed (wrong field, dtype, shape or id)."""


class QueueTimeoutError(RelaxError, TimeoutError):
    """A data-bus put waited for free capacity, or a get for ready rows, longer than its ``timeout_s``."""


class LeaseError(RelaxError, LookupError):
    """A data-bus lease id is unknown, or expired and its rows were already handed out again."""


class CheckpointError(RelaxError, OSError):
    """A checkpoint is missing, incomplete or does not match the run's config."""


class SandboxError(RelaxError, RuntimeError):
    """A sandbox could not be created, reached or cleaned up."""


class SandboxTimeoutError(SandboxError, TimeoutError):
    """Acquiring a sandbox or finishing an operation on it took longer than allowed."""


class RolloutError(RelaxError, RuntimeError):
    """A training step's rollouts gave nothing to learn from: no episode sampled a single policy
    token (the message names the cause, e.g. a prompt that fills ``rollout.max_total_tokens``)."""


class RewardServiceError(RelaxError, RuntimeError):
    """A reward service could not be reached or answered with an error."""


class AuthError(RewardServiceError, PermissionError):
    """A reward service refused the bearer token."""


class WeightSyncError(RelaxError, RuntimeError):
    """Weights could not be published or applied (layout mismatch, checksum, transport)."""


class WeightRefusedError(WeightSyncError):
    """A subscriber refused a published version (its receive, load or verification failed). An engine
    that refused it keeps its previous version, except an HF engine whose copy failed verification: it
    serves nothing until a later version verifies.

    Attributes:
        retryable: False when every refusal was one that publishing the same weights again cannot
            change (they do not fit the engine's layout).
    """

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class VersionGoneError(WeightSyncError):
    """The publisher no longer serves the version a subscriber asked for: newer ones replaced it
    while the subscriber was about to pull it (not a refusal; pull the latest instead)."""


class RuntimeServiceError(RelaxError, RuntimeError):
    """A role's service failed past its restart policy (``runtime.max_trainer_restarts`` spent, a
    supervising actor died)."""


class RoleDiedError(RuntimeServiceError):
    """An actor the run cannot go on without died (``runtime: ray``: the data bus, the weight
    coordinator or the heartbeat table; none is restarted, they hold the run's state). The message
    names the role, its actor and the root cause; the run resumes from its last checkpoint."""
