"""Field schemas of a data-bus partition: dtype, trailing shape, ragged first dimension.

A field holds one value per row (sample). Numeric fields hold numpy values: a row of
``FieldSpec("int64", ragged=True)`` is a 1-D array of any length (token ids ``[T]``), a row of
``FieldSpec("uint8", (layers, top_k), ragged=True)`` is ``[T, layers, top_k]`` (routed experts),
a row of ``FieldSpec("float32")`` is a scalar (reward). ``FieldSpec("object")`` holds any
picklable Python value (messages, metadata).

Values arrive in *chunks*: the values of one field for the rows of one put, either a numpy
array ``[rows, ...]`` (row ``i`` is ``chunk[i]``, kept without a copy) or a list of per-row
values. :func:`make_chunk` validates a chunk against a spec (or infers the spec on the first
put of a field) and returns it with each row's length along the ragged dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_agent.errors import DataError

OBJECT = "object"

# numpy kinds a Python scalar/list may have to be converted into a field of the given kind.
_ACCEPTS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "c": "iufc"}


@dataclass(frozen=True)
class FieldSpec:
    """What one field of a partition holds per row.

    Attributes:
        dtype: a numpy dtype name (``"int64"``, ``"uint8"``, ``"float32"``, ``"bool"``...) or
            ``"object"`` for arbitrary picklable Python values.
        shape: the fixed trailing shape of a row (after the ragged dimension if ``ragged``).
        ragged: rows have a leading dimension of any length (tokens, patches, frames).
    """

    dtype: str
    shape: tuple[int, ...] = ()
    ragged: bool = False

    def __post_init__(self) -> None:
        if self.dtype != OBJECT:
            try:
                name = np.dtype(self.dtype).name
            except TypeError as exc:
                raise DataError(f"FieldSpec dtype {self.dtype!r} is not a numpy dtype name or 'object'") from exc
            if np.dtype(name).kind not in _ACCEPTS:
                raise DataError(f"FieldSpec dtype {self.dtype!r}: use a bool/int/float/complex dtype or 'object'")
            object.__setattr__(self, "dtype", name)
            object.__setattr__(self, "_np_dtype", np.dtype(name))
        elif self.shape or self.ragged:
            raise DataError("FieldSpec('object') takes no shape and no ragged flag")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype (numeric fields only)."""
        return self._np_dtype  # type: ignore[attr-defined]

    @property
    def numeric(self) -> bool:
        """Whether the field is stored as a numpy array (any dtype but ``object``)."""
        return self.dtype != OBJECT

    @property
    def stacks(self) -> bool:
        """Rows of this field stack into one array ``[batch, *shape]`` (numeric, not ragged)."""
        return self.numeric and not self.ragged

    def row_shape_ok(self, shape: tuple[int, ...]) -> bool:
        """Whether one row's array ``shape`` fits: ``shape`` itself, or ``[n, *shape]`` for a ragged field."""
        if self.ragged:
            return len(shape) == len(self.shape) + 1 and shape[1:] == self.shape
        return shape == self.shape

    def __str__(self) -> str:
        if not self.numeric:
            return OBJECT
        dims = (["*"] if self.ragged else []) + [str(d) for d in self.shape]
        return f"{self.dtype}[{','.join(dims)}]" if dims else self.dtype


def parse_spec(value: FieldSpec | str | tuple) -> FieldSpec:
    """A :class:`FieldSpec` from itself, a dtype name, or a ``(dtype, shape[, ragged])`` tuple."""
    if isinstance(value, FieldSpec):
        return value
    if isinstance(value, str):
        return FieldSpec(value)
    return FieldSpec(*value)


@dataclass(frozen=True)
class Chunk:
    """One field's values for the rows of one put, validated.

    Attributes:
        values: ``np.ndarray [rows, ...]`` (read-only; row ``i`` is ``values[i]``) or a list.
        spec: the field's spec (the partition's, or inferred from these values).
        lengths: per row, the length of the ragged dimension (1 for non-ragged fields).
    """

    values: np.ndarray | list
    spec: FieldSpec
    lengths: list[int]


def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view


def _infer_row(value: Any) -> FieldSpec:
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
    elif isinstance(value, (bool, int, float, complex, list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged nested lists
            return FieldSpec(OBJECT)
    else:
        return FieldSpec(OBJECT)
    if arr.dtype.kind not in _ACCEPTS:
        return FieldSpec(OBJECT)
    if arr.ndim == 0:
        return FieldSpec(arr.dtype.name)
    return FieldSpec(arr.dtype.name, arr.shape[1:], ragged=True)


def infer_spec(values: np.ndarray | Sequence[Any], field: str = "?") -> FieldSpec:
    """The spec the first put of a field fixes: taken from its first row that says its type.

    An array ``[rows]`` gives a scalar field, ``[rows, n, *rest]`` a ragged field with trailing
    shape ``rest``; Python numbers and number lists become int64/float64/bool fields; anything
    else is ``"object"``. An empty Python list (``[]``) says nothing about its dtype, so the
    first non-empty row decides (``[[], [5, 6]]`` is int64, not numpy's float64 guess).

    Raises:
        DataError: every row is an empty Python list.
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in _ACCEPTS:
            return FieldSpec(OBJECT)
        if values.ndim == 1:
            return FieldSpec(values.dtype.name)
        return FieldSpec(values.dtype.name, values.shape[2:], ragged=True)
    for value in values:
        if not _untyped_empty(value):
            return _infer_row(value)
    raise DataError(f"field {field!r}: every row is an empty list, which has no dtype; pass numpy arrays "
                    "(np.array([], dtype=np.int64)) or create the partition with a schema")


def _untyped_empty(value: Any) -> bool:
    """A Python list/tuple with no numbers in it (``[]``, ``[[], []]``): numpy would guess float64."""
    if not isinstance(value, (list, tuple)):
        return False
    try:
        return np.asarray(value).size == 0
    except ValueError:  # ragged nested lists
        return False


def _convert_row(value: Any, spec: FieldSpec, field: str, sample_id: str) -> np.ndarray:
    where = f"field {field!r} of sample {sample_id!r}"
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype != spec.np_dtype:
            raise DataError(f"{where}: dtype {arr.dtype.name} does not match the partition's {spec}")
    else:
        try:
            probe = np.asarray(value)
        except ValueError as exc:
            raise DataError(f"{where}: {type(value).__name__} is not a rectangular {spec} value") from exc
        if probe.size and probe.dtype.kind not in _ACCEPTS[np.dtype(spec.dtype).kind]:  # [] has no dtype
            raise DataError(f"{where}: a {probe.dtype.name} value does not fit the partition's {spec}")
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                arr = np.asarray(value, dtype=spec.dtype)
        except (OverflowError, ValueError) as exc:
            raise DataError(f"{where}: value does not fit the partition's {spec}: {exc}") from exc
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all() and np.isfinite(probe).all():
            big = probe.flat[int(np.argmin(np.isfinite(arr).reshape(-1)))]
            raise DataError(f"{where}: {big!r} overflows the partition's {spec} (max "
                            f"{np.finfo(spec.np_dtype).max:.4g}); it would be stored as inf")
    if not spec.row_shape_ok(arr.shape):
        raise DataError(f"{where}: shape {list(arr.shape)} does not match the partition's {spec}")
    return _readonly(arr) if arr.ndim else arr


def make_chunk(
    field: str, values: np.ndarray | Sequence[Any], sample_ids: Sequence[str], spec: FieldSpec | None
) -> Chunk:
    """Validate one field's values for ``sample_ids`` against ``spec`` (``None``: infer it).

    Arrays of the field's dtype are kept without a copy (as a read-only view); Python numbers
    and lists are converted to the field's dtype.

    Raises:
        DataError: wrong number of values, dtype or shape (the message names field and sample).
    """
    n = len(sample_ids)
    if len(values) != n:
        raise DataError(f"field {field!r}: {len(values)} values for {n} sample ids")
    if n == 0:
        raise DataError(f"field {field!r}: a put needs at least one sample id")
    spec = spec or infer_spec(values, field)
    if not spec.numeric:
        return Chunk(list(values), spec, [1] * n)
    if isinstance(values, np.ndarray) and values.dtype == spec.np_dtype and spec.row_shape_ok(values.shape[1:]):
        length = values.shape[1] if spec.ragged else 1
        return Chunk(_readonly(values), spec, [length] * n)
    if isinstance(values, np.ndarray) and values.dtype != spec.np_dtype:
        raise DataError(
            f"field {field!r} of sample {sample_ids[0]!r}: dtype {values.dtype.name} does not match the partition's {spec}"
        )
    rows = [_convert_row(v, spec, field, sid) for v, sid in zip(values, sample_ids, strict=True)]
    if spec.stacks:
        return Chunk(_readonly(np.stack(rows) if rows[0].ndim else np.asarray(rows, dtype=spec.dtype)), spec, [1] * n)
    return Chunk(rows, spec, [len(r) for r in rows])


def assemble(spec: FieldSpec, pieces: Sequence[np.ndarray | list]) -> np.ndarray | list:
    """Join slices of chunks (in batch order) into one batch value.

    Stacking fields give ``np.ndarray [batch, *shape]`` -- the chunk itself, without a copy,
    when the batch is one contiguous slice of one chunk; other fields give a list of rows.
    """
    if spec.stacks:
        arrays = [p if isinstance(p, np.ndarray) else np.asarray(p, spec.dtype).reshape(len(p), *spec.shape)
                  for p in pieces]
        return _readonly(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))
    out: list = []
    for piece in pieces:
        out.extend(piece)
    return out
