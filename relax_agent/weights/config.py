"""Weight-sync config: which transport carries the trainer's weights to the rollout engines.

YAML::

    weights:
      transport: tcp          # inproc (colocate) | tcp (CPU, cross-host) | nccl (GPUs)
      bucket_mb: 64
      port: 0                 # 0: an ephemeral port, published through the coordinator
      verify: true            # engines check a digest of what they loaded against what was sent

``build_weight_sync(cfg, engines)`` (in :mod:`relax_agent.weights.sync`) turns it into a
:class:`~relax_agent.weights.sync.WeightSync`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from relax_agent.configbase import Section
from relax_agent.errors import ConfigError


class WeightSyncConfig(Section):
    """How new policy versions travel from the trainer to every rollout engine."""

    transport: Literal["inproc", "tcp", "nccl"] = "inproc"
    """"inproc": engines in this process copy straight from the trainer's tensors (colocate);
    "tcp": bucketed raw bytes over sockets (CPU clusters, cross-cluster rollouts);
    "nccl": bucketed ``torch.distributed`` broadcast between GPU processes."""
    bucket_mb: float = Field(default=64.0, gt=0.0)
    """Bytes per bucket, in MiB: the unit of streaming, checksumming and resuming."""
    host: str = "127.0.0.1"
    """tcp: address the weight server (and the coordinator service) binds to and advertises. Under
    ``runtime: ray`` on a joined cluster (``data.ray_address``) a loopback value binds the trainer's
    node address instead, and ``0.0.0.0`` binds every interface and advertises the trainer's node
    address; replicas on other hosts connect there. Every connection must prove the run's weight
    credential (:mod:`relax_agent.weights.auth`)."""
    port: int = Field(default=0, ge=0, le=65535)
    """tcp: port of the weight server; 0 picks a free one."""
    service_port: int | None = Field(default=None, ge=0, le=65535)
    """Also serve the coordinator over HTTP on ``host:service_port`` (0: a free port) so that
    rollout replicas in other processes can subscribe; None keeps it in-process only."""
    service_token_env: str | None = None
    """Environment variable that holds the run's weight credential, shared by the publisher and its
    replicas (as ``serve-reward --token-env``): the coordinator service's bearer token (every request
    needs it) and the secret a tcp subscriber proves it holds before the weight server sends it a
    byte (:mod:`relax_agent.weights.auth`). None: the publisher (or the Ray driver) makes a random
    one per run (``WeightSync.service_token``) and hands it to the replicas it starts."""
    checksum: Literal["xxh3", "crc32", "none"] = "xxh3"
    """Per-bucket checksum the publisher computes and every tcp subscriber verifies
    (xxh3 ~9 GB/s, crc32 ~1.9 GB/s per core here)."""
    snapshot: bool = True
    """tcp: copy the state dict into a publisher-owned buffer at publish, so subscribers (and
    late joiners) read one consistent version while the trainer updates its live tensors.
    False sends straight from the given (contiguous CPU) tensors, which must then stay
    unchanged until the next publish. (nccl always copies into its device buffer.)"""
    name_map: dict[str, str] = Field(default_factory=dict)
    """Publisher name -> engine name for parameters whose names differ in the engine's layout
    (names not listed pass unchanged)."""
    check_finite: bool = True
    """Refuse to publish a state dict with NaN or inf in a floating-point tensor (a diverged or
    overflowed update), so engines keep their last good version; costs one reduction pass over the
    weights (~0.2 s for 512 MiB fp32 on 2 CPU cores)."""
    verify: bool = True
    """After an engine loads a version, compare a digest of the weights it now holds (its own layout
    and dtype) with one of the tensors that were sent (:mod:`relax_agent.weights.digest`); a mismatch
    refuses the version naming the tensor, and that engine serves no version until a later one
    verifies. Costs a strided sample per tensor (``weights/verify_s`` per publish). Engines that
    cannot report a digest are loaded unverified (logged once)."""
    verify_samples: int = Field(default=2048, ge=16)
    """Elements per tensor the digest hashes: ``verify_samples // 16`` evenly spaced blocks of 16
    plus the last 16 (tensors this small or smaller in full); the cost grows with the blocks."""
    publish_timeout_s: float = Field(default=600.0, gt=0.0)
    """How long ``publish`` waits for every attached engine to apply the version; one that has not
    by then is reported as lagging (``SyncStats.lagging``), not waited for again until it catches
    up, and keeps following on its own."""
    publish_retries: int = Field(default=2, ge=0, le=10)
    """Times a version some subscriber refused (bytes that differ from what was sent, a load or a
    verification that failed: often transient) is published again, the same weights under the same
    number, before the run ends with the refusal; only while no engine applied it, and never for
    weights that do not fit an engine's layout. Each retry is logged (``weights/publish_retries``)."""
    subscriber_silence_s: float = Field(default=60.0, gt=0.0)
    """A publish stops waiting for a subscriber that has not talked to the coordinator for this long
    (no long poll open, no report, no keep-alive while it applies a version) and unregisters it
    (``weights/subscribers_dropped``; a live one registers again on its next poll). Subscribers send a
    keep-alive every quarter of it while they receive and load a version."""
    connect_timeout_s: float = Field(default=10.0, gt=0.0)
    """tcp: connecting to the weight server, and the idle limit of one socket read or write."""
    poll_timeout_s: float = Field(default=30.0, gt=0.0)
    """Long-poll length of a subscriber waiting for a new version."""
    max_reconnects: int = Field(default=5, ge=0)
    """tcp: reconnections per version (each resumes after the last complete bucket)."""
    nccl_backend: Literal["nccl", "gloo"] = "nccl"
    """nccl: ``torch.distributed`` backend ("gloo" runs the same code on CPU)."""
    nccl_world_size: int = Field(default=2, ge=2)
    """nccl: the publisher (rank 0) plus one rank per subscriber process."""
    nccl_init_port: int = Field(default=29517, ge=1, le=65535)
    """nccl: TCP port of the process-group rendezvous on ``host``."""

    def read_service_token(self) -> str | None:
        """The bearer token from ``service_token_env`` (None when that is unset).

        Raises:
            ConfigError: the environment variable it names is unset or empty.
        """
        if self.service_token_env is None:
            return None
        token = os.environ.get(self.service_token_env, "")
        if not token:
            raise ConfigError(f"weights.service_token_env={self.service_token_env!r}: that environment variable "
                              "(the coordinator service's bearer token) is unset or empty")
        return token

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes, rounded to a multiple of 64."""
        return max(64, int(self.bucket_mb * 2**20) // 64 * 64)
