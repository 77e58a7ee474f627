"""Per-version weight metadata and the flat byte layout every transport shares.

A published version is laid out as one virtual byte string: each tensor's raw bytes at a
64-byte-aligned offset (zeros in the gaps), cut into fixed-size buckets. Tensors that share
storage (tied embeddings) are sent once: the second name is an alias of the first.
``VersionMeta`` holds names, shapes, dtypes, offsets, bucket checksums and where to fetch
the bytes; it travels as JSON through the coordinator.
"""

from __future__ import annotations

import concurrent.futures
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from relax_agent.errors import ConfigError, WeightSyncError

ALIGN_BYTES = 64

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""name -> (shape, dtype) of the tensors one side sends or accepts."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> ``torch.bfloat16``.

    Raises:
        WeightSyncError: a dtype this module does not carry.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightSyncError(f"unsupported tensor dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives in a version's flat bytes.

    Attributes:
        name: parameter name as the publisher calls it.
        shape: tensor shape.
        dtype: torch dtype name ("float32").
        offset: byte offset in the flat layout (multiple of 64).
        nbytes: ``numel * element_size``.
        alias_of: name of an earlier tensor with the same storage (tied weights); its
            bytes are not sent again and ``offset`` equals that tensor's.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    alias_of: str | None = None


@dataclass(frozen=True)
class VersionMeta:
    """Everything a subscriber needs to receive and check one policy version.

    Attributes:
        version: policy version (strictly increasing per publisher).
        tensors: one entry per name, in publisher order.
        total_bytes: size of the flat layout (bytes moved per subscriber).
        bucket_bytes: bucket size; bucket ``i`` covers ``[i*bucket_bytes, min((i+1)*bucket_bytes, total_bytes))``.
        checksum: "xxh3", "crc32" or "none".
        bucket_checksums: one per bucket (empty when ``checksum == "none"``).
        transport: "inproc", "tcp" or "nccl".
        address: where the bytes are served ("host:port" for tcp), if anywhere.
        commit: serial the coordinator stamps on each commit (0 before), so a version number
            published again after a refusal is told apart from the refused one.
        epoch: run id of the coordinator that committed it ("" before): version numbers of
            different runs (a restarted publisher starts again at 0 or 1) are told apart by it.
        digests: ``weights.verify`` over a transport that moves bytes (tcp, nccl): name ->
            ``TensorDigest.to_json()`` of each sent tensor in its published dtype
            (:mod:`relax_agent.weights.digest`), which a subscriber checks the received tensors
            against before loading them; empty otherwise.
    """

    version: int
    tensors: tuple[TensorMeta, ...]
    total_bytes: int
    bucket_bytes: int
    checksum: str
    bucket_checksums: tuple[int, ...] = ()
    transport: str = "inproc"
    address: str | None = None
    commit: int = 0
    epoch: str = ""
    digests: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def num_buckets(self) -> int:
        """Buckets the flat byte buffer is sent in: ``ceil(total_bytes / bucket_bytes)``."""
        return -(-self.total_bytes // self.bucket_bytes)

    def bucket(self, index: int) -> tuple[int, int]:
        """``(start, end)`` byte range of bucket ``index``."""
        start = index * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor of this version."""
        return {t.name: (t.shape, to_dtype(t.dtype)) for t in self.tensors}

    def to_json(self) -> dict[str, Any]:
        """The metadata as a JSON-ready dict (:meth:`from_json` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VersionMeta:
        """The inverse of :meth:`to_json`.

        Raises:
            WeightSyncError: ``data`` is not a version's metadata (missing or unknown keys, wrong
                types, a negative version or size); names what is wrong.
        """
        try:
            tensors = tuple(TensorMeta(**{**t, "shape": tuple(int(d) for d in t["shape"])}) for t in data["tensors"])
            meta = cls(**{**data, "tensors": tensors, "bucket_checksums": tuple(data["bucket_checksums"])})
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightSyncError(f"malformed version metadata ({type(exc).__name__}: {exc}); expected the keys "
                                  f"of VersionMeta.to_json()") from exc
        ints = {"version": meta.version, "total_bytes": meta.total_bytes, "bucket_bytes": meta.bucket_bytes,
                "commit": meta.commit}
        for key, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (key == "bucket_bytes" and value == 0):
                raise WeightSyncError(f"malformed version metadata: {key}={value!r}; expected a "
                                      f"{'positive' if key == 'bucket_bytes' else 'non-negative'} int")
        if not isinstance(meta.digests, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) == 4 for k, v in meta.digests.items()):
            raise WeightSyncError("malformed version metadata: digests must map tensor names to "
                                  "[shape, dtype, sample hash, samples]")
        for t in meta.tensors:
            if not isinstance(t.name, str) or not isinstance(t.offset, int) or not isinstance(t.nbytes, int) \
                    or t.offset < 0 or t.nbytes < 0 or any(d < 0 for d in t.shape):
                raise WeightSyncError(f"malformed version metadata: tensor {t.name!r} has offset={t.offset!r}, "
                                      f"nbytes={t.nbytes!r}, shape={t.shape!r}; expected non-negative ints")
            to_dtype(t.dtype)
        return meta


def plan_layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorMeta, ...], int]:
    """Offsets for ``state_dict``'s tensors in a flat layout: ``(tensors, total_bytes)``.

    Tensors with the same storage, offset, shape, stride and dtype become aliases.
    """
    metas: list[TensorMeta] = []
    seen: dict[tuple[Any, ...], TensorMeta] = {}
    offset = 0
    for name, tensor in state_dict.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype)
        first = seen.get(key)
        if first is not None:
            metas.append(TensorMeta(name, first.shape, first.dtype, first.offset, first.nbytes, alias_of=first.name))
            continue
        nbytes = tensor.numel() * tensor.element_size()
        meta = TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype), offset, nbytes)
        metas.append(meta)
        seen[key] = meta
        offset = _align(offset + nbytes)
    return tuple(metas), offset


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def flat_views(buffer: torch.Tensor, tensors: tuple[TensorMeta, ...]) -> dict[str, torch.Tensor]:
    """name -> typed, shaped view of ``buffer`` ([total_bytes] uint8) at each tensor's offset (no copy)."""
    views = {}
    for t in tensors:
        raw = buffer[t.offset:t.offset + t.nbytes]
        views[t.name] = raw.view(to_dtype(t.dtype)).view(t.shape)
    return views


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data


class FlatSource:
    """Read access to a version's flat bytes, either from one buffer or straight from the tensors.

    Args:
        tensors: the layout (from :func:`plan_layout`).
        total_bytes: its size.
        buffer: a [total_bytes] uint8 CPU tensor holding the flat bytes, or None to read the
            ``state_dict`` tensors in place (each must be a contiguous CPU tensor).
        state_dict: the tensors, when ``buffer`` is None.
    """

    def __init__(self, tensors: tuple[TensorMeta, ...], total_bytes: int, buffer: torch.Tensor | None = None,
                 state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        self.tensors = tensors
        self.total_bytes = total_bytes
        self._buffer = buffer.numpy().data if buffer is not None else None
        self._pieces: list[tuple[int, memoryview]] = []
        if buffer is None:
            assert state_dict is not None
            for t in tensors:
                if t.alias_of is None:
                    self._pieces.append((t.offset, byte_view(_contiguous_cpu(state_dict[t.name], t.name))))

    def segments(self, start: int, end: int) -> Iterator[memoryview]:
        """Memoryviews covering bytes ``[start, end)`` in order (zeros in alignment gaps)."""
        if self._buffer is not None:
            yield self._buffer[start:end]
            return
        pos = start
        for offset, view in self._pieces:
            piece_end = offset + len(view)
            if piece_end <= pos:
                continue
            if offset >= end:
                break
            if offset > pos:
                yield memoryview(bytes(offset - pos))
                pos = offset
            stop = min(piece_end, end)
            yield view[pos - offset:stop - offset]
            pos = stop
        if pos < end:
            yield memoryview(bytes(end - pos))


def _contiguous_cpu(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise WeightSyncError(f"{name}: sending without a snapshot needs contiguous CPU tensors "
                              f"(got {tensor.device}, contiguous={tensor.is_contiguous()}); set weights.snapshot=true")
    return tensor


def snapshot_into(buffer: torch.Tensor, state_dict: Mapping[str, torch.Tensor],
                  tensors: tuple[TensorMeta, ...]) -> None:
    """Copy each non-alias tensor of ``state_dict`` into ``buffer`` ([total_bytes] uint8) at its offset."""
    views = flat_views(buffer, tuple(t for t in tensors if t.alias_of is None))
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(state_dict[name])


def snapshot_with_checksums(buffer: torch.Tensor, state_dict: Mapping[str, torch.Tensor],
                            tensors: tuple[TensorMeta, ...], bucket_bytes: int, algo: str) -> tuple[int, ...]:
    """:func:`snapshot_into` plus :func:`bucket_checksums` of the result, overlapped.

    Tensors are copied in offset order; each bucket is checksummed on a worker thread as
    soon as every tensor it covers has been copied (both release the GIL).
    """
    if algo == "none":
        snapshot_into(buffer, state_dict, tensors)
        return ()
    fn, total = checksum_fn(algo), buffer.numel()
    view = buffer.numpy().data
    starts = list(range(0, total, bucket_bytes))
    futures: list[concurrent.futures.Future[int]] = []
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-checksum") as pool, torch.no_grad():
        for t in sorted((t for t in tensors if t.alias_of is None), key=lambda t: t.offset):
            buffer[t.offset:t.offset + t.nbytes].view(to_dtype(t.dtype)).view(t.shape).copy_(state_dict[t.name])
            while len(futures) < len(starts) and min(starts[len(futures)] + bucket_bytes, total) <= t.offset + t.nbytes:
                start = starts[len(futures)]
                futures.append(pool.submit(fn, iter([view[start:min(start + bucket_bytes, total)]])))
        for start in starts[len(futures):]:
            futures.append(pool.submit(fn, iter([view[start:min(start + bucket_bytes, total)]])))
        return tuple(f.result() for f in futures)


def checksum_fn(algo: str) -> Callable[[Iterator[memoryview]], int]:
    """A function from byte segments to their checksum ("xxh3": xxh3_64, "crc32": zlib).

    Raises:
        ConfigError: unknown ``algo``.
    """
    if algo == "xxh3":
        import xxhash

        def xxh3(segments: Iterator[memoryview]) -> int:
            h = xxhash.xxh3_64()
            for seg in segments:
                h.update(seg)
            return h.intdigest()
        return xxh3
    if algo == "crc32":
        def crc32(segments: Iterator[memoryview]) -> int:
            value = 0
            for seg in segments:
                value = zlib.crc32(seg, value)
            return value
        return crc32
    raise ConfigError(f"checksum={algo!r}; expected 'xxh3', 'crc32' or 'none'")


def bucket_checksums(source: FlatSource, bucket_bytes: int, algo: str) -> tuple[int, ...]:
    """The checksum of every bucket of ``source`` (empty for ``algo == "none"``)."""
    if algo == "none":
        return ()
    fn = checksum_fn(algo)
    return tuple(fn(source.segments(s, min(s + bucket_bytes, source.total_bytes)))
                 for s in range(0, source.total_bytes, bucket_bytes))


def layout_diff(published: Layout, accepted: Layout) -> list[str]:
    """Differences that make a published layout unusable for an engine (empty: compatible).

    Names must match exactly and shapes must be equal; dtypes may differ only between
    floating-point types (fp32 master weights cast to a bf16/fp16 engine).
    """
    lines = [f"missing in the engine: {n}" for n in published if n not in accepted]
    lines += [f"not published: {n}" for n in accepted if n not in published]
    for name, (shape, dtype) in published.items():
        if name not in accepted:
            continue
        want_shape, want_dtype = accepted[name]
        if tuple(shape) != tuple(want_shape):
            lines.append(f"shape of {name}: published {tuple(shape)}, engine {tuple(want_shape)}")
        if dtype != want_dtype and not (dtype.is_floating_point and want_dtype.is_floating_point):
            lines.append(f"dtype of {name}: published {dtype_name(dtype)}, engine {dtype_name(want_dtype)}")
    return lines


def format_diff(lines: list[str], limit: int = 20) -> str:
    """The first ``limit`` differences, one per line, and how many more there are."""
    shown = "\n  ".join(lines[:limit])
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return f"{len(lines)} differences:\n  {shown}{more}"

