"""Checks of what a put or read names: sample and group ids, policy versions, and a field whose values
already sit in an object store (its dtype and row shapes against the partition's spec)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from relax_agent.data.schema import FieldSpec
from relax_agent.data.store.state import RefField
from relax_agent.errors import DataError


def check_ids(partition: str, what: str, ids: Any) -> list[str]:
    """``ids`` (sample or group ids) as a list of str, each given as a str: ``1`` and ``"1"`` would
    be one row after ``str()``, and a bare string would be read as one id per character.

    Raises:
        DataError: ``ids`` is a str/bytes or not a sequence, or an element is not a str; names it.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise DataError(f"partition {partition!r}: {what}={ids!r} ({type(ids).__name__}) is not a sequence of "
                        f"ids; expected a list of str (e.g. [{ids!r}] for one row)")
    out = list(ids)
    for i, sid in enumerate(out):
        if not isinstance(sid, str):
            raise DataError(f"partition {partition!r}: {what}[{i}]={sid!r} ({type(sid).__name__}) is not an id; "
                            "expected a str (ids are compared as given: 1 and '1' would collide)")
    return [str(sid) for sid in out]


def check_versions(partition: str, versions: Sequence[Any]) -> list[int]:
    """``versions`` as Python ints: each a non-negative integer (numpy integers count; bool does not).

    Raises:
        DataError: a value is not a non-negative integer; names the value and its index.
    """
    out = []
    for i, v in enumerate(versions):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0:
            raise DataError(f"partition {partition!r}: versions[{i}]={v!r} ({type(v).__name__}) is not a policy "
                            "version; expected a non-negative int")
        out.append(int(v))
    return out


def check_ref(partition: str, name: str, ref: RefField, ids: list[str],
              spec: FieldSpec | None) -> tuple[FieldSpec, list[int]]:
    """Check a put's reference field ``name`` against ``spec`` (inferred when None); the spec and each row's length."""
    if len(ref.row_shapes) != len(ids):
        raise DataError(f"field {name!r}: {len(ref.row_shapes)} values for {len(ids)} sample ids")
    first = tuple(ref.row_shapes[0])
    if spec is None:
        spec = FieldSpec(ref.dtype) if ref.dtype == "object" or not first else FieldSpec(ref.dtype, first[1:], True)
    if ref.dtype != spec.dtype:
        raise DataError(f"partition {partition!r}: field {name!r} of sample {ids[0]!r}: dtype {ref.dtype} does not "
                        f"match the partition's {spec}")
    if not spec.numeric:
        return spec, [1] * len(ids)
    for sid, shape in zip(ids, ref.row_shapes, strict=True):
        if not spec.row_shape_ok(tuple(shape)):
            raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r}: shape {list(shape)} does "
                            f"not match the partition's {spec}")
    return spec, [int(s[0]) if spec.ragged else 1 for s in ref.row_shapes]
