"""Weight digests: check, after an engine loaded a version, that it holds what was published.

A :class:`TensorDigest` summarises one tensor *as the engine holds it*: its shape, its dtype and
a 64-bit hash (BLAKE2b) of a fixed, evenly strided sample of its elements in that dtype. The
expected digest of a published tensor is computed the same way from the tensor the transport
delivered, cast to the engine's dtype first (``copy_`` into a bf16 parameter rounds exactly like
``.to(torch.bfloat16)``), so the two are compared for equality, with no tolerance.

Why a strided sample and not a full pass. Loading a version is itself one read and one write of
the weights (plus the publisher's finite check, another read); any digest that reads every
element adds a pass of the same order: a float64 sum and sum of squares of SmolLM2-135M costs
about a third of its in-process sync on this project's CPUs, far above the 5 % budget
(``benchmarks/weight_verify.py`` prints both). The sample takes ``samples`` elements per tensor
(every ``numel // samples``-th, plus the last one), a few hundred KiB of cache lines for a whole
135M model, so it costs a few percent of the sync. What it catches: a tensor that was not loaded
or was loaded from the wrong source (a training step moves nearly every element, so the sample
differs), one loaded with another shape, dtype or layout (transposed, permuted, a fused
projection filled in the wrong order), a corrupted or truncated copy, and any corrupted region
longer than ``numel / samples`` elements; a tensor with ``numel <= samples`` is hashed in full.
What it does not catch: a single corrupted element (or a short run) between two sampled ones.

Functions here never raise on a mismatch; :func:`compare` lists the differences and the caller
decides (the engines refuse the version, see :mod:`relax_agent.weights.subscriber`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

DEFAULT_SAMPLES = 4096
"""Elements sampled per tensor (every ``numel // samples``-th one, plus the last)."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor's digest in the engine's layout.

    Attributes:
        shape: the tensor's shape.
        dtype: torch dtype name ("bfloat16") the sample was hashed in.
        sample_hash: BLAKE2b-64 of the sampled elements' raw bytes, hex.
        samples: the ``samples`` it was computed with (the engine's digest must use the same).
    """

    shape: tuple[int, ...]
    dtype: str
    sample_hash: str
    samples: int = DEFAULT_SAMPLES

    def to_json(self) -> list[Any]:
        return [list(self.shape), self.dtype, self.sample_hash, self.samples]

    @classmethod
    def from_json(cls, data: Any) -> "TensorDigest":
        shape, dtype, sample_hash, samples = data
        return cls(tuple(int(d) for d in shape), str(dtype), str(sample_hash), int(samples))


def sample_indices(numel: int, samples: int = DEFAULT_SAMPLES) -> slice:
    """The strided slice of a flattened tensor's elements that is hashed (all of them when
    ``numel <= samples``); the last element is hashed too (see :func:`tensor_digest`)."""
    return slice(0, numel, max(1, numel // max(1, samples)))


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype | None = None,
                  samples: int = DEFAULT_SAMPLES) -> TensorDigest:
    """Digest of ``tensor`` (any shape, any device) as held in ``dtype`` (default: its own).

    Only the sampled elements are gathered, cast and copied to the CPU (``samples + 1`` of them),
    so the cost does not grow with the tensor beyond the strided reads.
    """
    dtype = tensor.dtype if dtype is None else dtype
    with torch.no_grad():
        flat = tensor.detach().reshape(-1)
        numel = flat.numel()
        if numel:
            picked = torch.cat([flat[sample_indices(numel, samples)], flat[-1:]])
            picked = picked.to(device="cpu", dtype=dtype).contiguous()
            raw = picked.view(torch.uint8).numpy().tobytes() if picked.element_size() else b""
        else:
            raw = b""
    h = hashlib.blake2b(raw, digest_size=8)
    h.update(repr((tuple(tensor.shape), str(dtype))).encode())
    return TensorDigest(tuple(int(d) for d in tensor.shape), str(dtype).removeprefix("torch."), h.hexdigest(), samples)


def expected_digests(state_dict: Mapping[str, torch.Tensor], layout: Mapping[str, tuple[Any, torch.dtype]] | None,
                     samples: int = DEFAULT_SAMPLES) -> dict[str, TensorDigest]:
    """Digests of the tensors being sent (engine names), each cast to the engine's dtype from
    ``layout`` (name -> (shape, dtype), e.g. ``engine.weight_layout()``; None or a missing name:
    the tensor's own dtype)."""
    out = {}
    for name, tensor in state_dict.items():
        dtype = layout[name][1] if layout is not None and name in layout else tensor.dtype
        if not (tensor.dtype.is_floating_point and dtype.is_floating_point):
            dtype = tensor.dtype
        out[name] = tensor_digest(tensor, dtype, samples)
    return out


def compare(expected: Mapping[str, TensorDigest], actual: Mapping[str, TensorDigest | None]) -> list[str]:
    """One line per tensor of ``expected`` whose engine digest differs or is missing (empty: all match)."""
    lines = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            lines.append(f"{name}: the engine holds no such tensor after the load")
        elif got.shape != want.shape:
            lines.append(f"{name}: the engine holds shape {got.shape}, published {want.shape}")
        elif got.dtype != want.dtype:
            lines.append(f"{name}: the engine holds dtype {got.dtype}, expected {want.dtype}")
        elif got.sample_hash != want.sample_hash:
            lines.append(f"{name}: the engine's values differ from the published ones "
                         f"(sample hash {got.sample_hash}, expected {want.sample_hash})")
    return lines
