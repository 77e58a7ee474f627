"""Weight digests: check, after an engine loaded a version, that it holds what was published.

A :class:`TensorDigest` summarises one tensor *as the engine holds it*: its shape, its dtype and
a CRC-32 of a fixed sample of its elements in that dtype. The expected digest of a published
tensor is computed the same way from the tensor the transport delivered, cast to the engine's
dtype first (``copy_`` into a bf16 parameter rounds exactly like ``.to(torch.bfloat16)``), so
the two are compared for equality, with no tolerance.

The sample (:func:`sample_index`): ``samples // 16`` blocks of 16 consecutive elements spread
evenly over the flattened tensor, plus its last 16 elements; tensors of at most ``samples``
elements are hashed in full (norms, biases). Why not a full pass: loading a version is itself
one read and one write of every weight (plus the publisher's finite check, another read), and a
digest that reads every element adds a pass of the same order on each side: a float64 sum and sum
of squares of SmolLM2-135M cost 0.8-3x its whole in-process sync in ``benchmarks/weight_verify.py``
runs. A sample's cost is set by the cache lines it touches, not the elements: a block of
16 fp32 elements is one 64-byte line, so 128 blocks per tensor cost ~128 memory accesses; with the
per-tensor overhead (~8 us) both sides cost ~8 ms for the 135M model's 273 tensors, and the
expected side runs while the engine copies.

What it catches: a tensor that was not loaded, or loaded from another version or tensor (a
training step moves nearly every element, so every block differs); one held with another shape,
dtype or layout (transposed, permuted, a fused projection filled in the wrong order); a truncated
copy (the tail block); any corrupted region longer than ``numel / (samples // 16)`` elements (a
missing tensor-parallel shard, a bucket written at the wrong offset). What it does not catch:
corruption confined to elements between two blocks (a single element, a row of a large matrix
that no block touches).

Functions here never raise on a mismatch; :func:`compare` lists the differences and the caller
decides (the engines refuse the version, see :mod:`relax_agent.weights.subscriber`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from relax_agent.errors import WeightSyncError

DEFAULT_SAMPLES = 2048
"""Elements sampled per tensor (:func:`sample_index`)."""

BLOCK = 16
"""Consecutive elements per sampled block: one 64-byte cache line of fp32, so a block costs one
memory access, as a single element would."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor's digest in the engine's layout.

    Attributes:
        shape: the tensor's shape.
        dtype: torch dtype name ("bfloat16") the sample was hashed in.
        sample_hash: CRC-32 of the shape and dtype, then of the sampled elements' raw bytes, hex.
        samples: the ``samples`` it was computed with (the engine's digest must use the same).
    """

    shape: tuple[int, ...]
    dtype: str
    sample_hash: str
    samples: int = DEFAULT_SAMPLES

    def to_json(self) -> list[Any]:
        """``[shape, dtype, sample_hash, samples]`` (the JSON form :meth:`from_json` reads)."""
        return [list(self.shape), self.dtype, self.sample_hash, self.samples]

    @classmethod
    def from_json(cls, data: Any) -> TensorDigest:
        """The inverse of :meth:`to_json`."""
        shape, dtype, sample_hash, samples = data
        return cls(tuple(int(d) for d in shape), str(dtype), str(sample_hash), int(samples))


def sample_index(numel: int, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """[k] int64 indices of a flattened tensor's elements that are hashed: every element when
    ``numel <= samples``; else ``samples // 16`` blocks of :data:`BLOCK` consecutive elements, one
    every ``numel // (samples // 16)`` elements from the first, then the last :data:`BLOCK` elements."""
    if numel <= samples:
        return torch.arange(numel)
    blocks = max(1, samples // BLOCK)
    starts = torch.arange(blocks) * (numel // blocks)
    return torch.cat([(starts[:, None] + torch.arange(BLOCK)).reshape(-1), torch.arange(numel - BLOCK, numel)])


@functools.lru_cache(maxsize=512)
def _index(numel: int, samples: int, device: str) -> torch.Tensor:
    return sample_index(numel, samples).to(device)


@functools.lru_cache(maxsize=512)
def _np_index(numel: int, samples: int) -> np.ndarray:
    return sample_index(numel, samples).numpy()


@functools.lru_cache(maxsize=4096)
def _meta_crc(shape: tuple[int, ...], dtype: str) -> int:
    return zlib.crc32(repr((shape, dtype)).encode())


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype | None = None,
                  samples: int = DEFAULT_SAMPLES) -> TensorDigest:
    """Digest of ``tensor`` (any shape, any device) as held in ``dtype`` (default: its own).

    Only the sampled elements (:func:`sample_index`) are gathered, cast and copied to the CPU.
    A contiguous CPU tensor kept in its own dtype (an engine's parameters; an fp32 engine's
    expected digests) is gathered through numpy as raw same-size integers, bit for bit, which
    costs a few microseconds per tensor; otherwise one ``index_select`` (then the cast). The
    hash is CRC-32 of ``repr((shape, "torch.<dtype>"))``, then of the gathered bytes.
    """
    dtype = tensor.dtype if dtype is None else dtype
    shape = tuple(tensor.shape)
    crc = _meta_crc(shape, str(dtype))
    numel = tensor.numel()
    if numel:
        if dtype == tensor.dtype and tensor.device.type == "cpu" and tensor.is_contiguous():
            held = tensor.detach()
            if held.dtype not in _NUMPY_DTYPES:  # bfloat16, float8: their bits as same-size integers
                held = held.view(_SAME_SIZE_INT[held.element_size()])
            crc = zlib.crc32(held.numpy().reshape(-1)[_np_index(numel, samples)], crc)
        else:
            with torch.no_grad():
                flat = tensor.detach().reshape(-1)
                picked = flat.index_select(0, _index(numel, samples, str(flat.device)))
                if picked.dtype != dtype:
                    picked = picked.to(dtype)
                if picked.device.type != "cpu":
                    picked = picked.cpu()
                crc = zlib.crc32(picked.view(torch.uint8).numpy().data, crc)
    return TensorDigest(shape, str(dtype).removeprefix("torch."), f"{crc:08x}", samples)


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


Expected = Union[Mapping[str, TensorDigest], "concurrent.futures.Future[Mapping[str, TensorDigest]]"]
"""What an engine's ``load_weights(..., expected_digests=)`` gets: the digests, or a future of them
(the subscriber computes them on a worker thread while the engine copies, see :func:`verify_held`)."""


def resolve(expected: Expected) -> Mapping[str, TensorDigest]:
    """``expected`` itself, or the result of the future computing it (waits for it)."""
    return expected.result() if isinstance(expected, concurrent.futures.Future) else expected


def verify_held(expected: Expected,
                held: Callable[[Mapping[str, TensorDigest]], Mapping[str, TensorDigest | None]]) -> list[str]:
    """:func:`compare` of the expected digests (resolved) with ``held(expected)``, the engine's
    digests of what it now holds. An exception on either side (the future's included) becomes a
    difference line, so an engine refuses a version it could not verify."""
    try:
        want = resolve(expected)
        return compare(want, held(want))
    except Exception as exc:  # the version must not be served unverified
        return [f"the digests could not be computed: {type(exc).__name__}: {exc}"]


def load_failure(expected: Expected, held: Callable[[Mapping[str, TensorDigest]], Mapping[str, TensorDigest | None]],
                 version: int) -> tuple[float, WeightSyncError | None]:
    """An engine's check after it copied ``version`` in: (seconds spent, the error to raise or None).

    The error's ``unverified`` attribute is the reason the engine then gives for serving nothing."""
    start = time.perf_counter()
    diff = verify_held(expected, held)
    spent = time.perf_counter() - start
    if not diff:
        return spent, None
    err = WeightSyncError(f"load_weights: version {int(version)}: what the engine holds after the load differs from "
                          f"what was sent in {len(diff)} tensor(s); not served (weights.verify):\n  "
                          + "\n  ".join(diff[:20]))
    err.unverified = (f"version {int(version)} failed weight verification after the load ({diff[0]}); "  # type: ignore[attr-defined]
                      "this engine serves no version until a later one verifies")
    return spent, err


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
