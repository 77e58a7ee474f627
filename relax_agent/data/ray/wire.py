"""How a reply's values travel between the metadata actor and a reader: object-store references
passed through, inline values pickled by the actor and unpickled by the reader (checked picklable at
put), and which rows' values were lost with their producer."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from relax_agent.data.schema import assemble
from relax_agent.data.store import RefField
from relax_agent.errors import DataError


@dataclass(frozen=True)
class InStore:
    """A reference to a chunk in the object store, as the actor hands it out (Ray passes
    references nested in a value through without resolving them)."""

    ref: Any


@dataclass(frozen=True)
class _Inline:
    """A slice of a stored chunk that travels inside a ``get`` reply: item ``index`` of the reply's
    pickled ``inline`` list (pickled by the actor, unpickled by the reader, so that a value one
    side cannot handle fails one read, whose lease is then released, and nothing else)."""

    index: int


@dataclass(frozen=True)
class Parked:
    """A channel reply that holds object references: fetch it through Ray with ``unpark``."""

    token: int


LOST = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
"""What ``ray.get`` raises for a value freed with its owner."""


def pack(taken: Any) -> tuple[dict[str, list[tuple[Any, int, int]]], bytes]:
    """A reply's field pieces (object-store references stay references) and its pickled inline values.

    Raises:
        DataError: a value cannot be pickled for the reader.
    """
    inline: list[Any] = []
    pieces: dict[str, list[tuple[Any, int, int]]] = {}
    for name, segments in taken.segments.items():
        pieces[name] = []
        for stored, start, stop in segments:
            if stored.is_ref:
                pieces[name].append((InStore(stored.values), start, stop))
            else:
                pieces[name].append((_Inline(len(inline)), 0, stop - start))
                inline.append(stored.values[start:stop])
    try:
        return pieces, pickle.dumps(inline, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise DataError(f"rows {taken.sample_ids} hold values that cannot be pickled for the reader "
                        f"({type(exc).__name__}: {exc}); a lease on them is released") from exc


def unpickle_rows(blob: bytes) -> list[Any]:
    """The inline values of a ``get`` reply (the seam where a reader meets values it cannot load)."""
    return pickle.loads(blob)


def check_picklable(partition: str, sample_ids: list[str], fields: dict[str, Any]) -> None:
    """Refuse inline values that plain pickle cannot carry to a reader: the socket channel pickles
    every reply, so a value only Ray's cloudpickle handles (a lambda, a class defined in a
    driver's ``__main__``) would fail every read of its row.

    Raises:
        DataError: names the field, the sample and the pickling error.
    """
    for name, values in fields.items():
        if isinstance(values, RefField) or (isinstance(values, np.ndarray) and values.dtype.kind != "O"):
            continue
        try:
            pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            for sid, value in zip(sample_ids, values, strict=True):
                try:
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r}: a "
                                    f"{type(value).__name__} value cannot be pickled by the bus "
                                    f"({type(exc).__name__}: {exc}); put values whose classes every process "
                                    "can import (no lambdas, local or __main__ classes)") from exc
            raise


def unpack(partition: str, ids: list[str], pieces: dict[str, list[tuple[Any, int, int]]], specs: dict[str, Any],
           blob: bytes, then: str) -> dict[str, np.ndarray | list]:
    """The fields of a ``get`` or ``read`` reply: inline values unpickled, object-store pieces fetched.

    Raises:
        DataError: a value this process cannot unpickle, or one whose producer died (``then`` says
            what became of the rows).
    """
    refs = list({box.ref: None for segs in pieces.values() for box, _, _ in segs if isinstance(box, InStore)})
    try:
        inline = unpickle_rows(blob)
    except Exception as exc:
        raise DataError(f"partition {partition!r}: rows {ids} hold values this process cannot unpickle "
                        f"({type(exc).__name__}: {exc}); {then} (put values whose classes "
                        "every process of the cluster can import)") from exc
    try:
        resolved = dict(zip(refs, ray.get(refs), strict=True))
    except LOST as exc:
        raise DataError(f"partition {partition!r}: rows {ids} hold values whose producer process died "
                        f"({type(exc).__name__}); {then}; clear the partition") from exc
    out = {}
    for name, segs in pieces.items():
        parts = [(resolved[box.ref] if isinstance(box, InStore) else inline[box.index])[start:stop]
                 for box, start, stop in segs]
        out[name] = assemble(specs[name], parts)
    return out


def dead_rows(pieces: dict[str, list[tuple[Any, int, int]]]) -> list[int]:
    """Batch positions of rows whose object-store values are lost (owner died, object freed); empty
    when every value is reachable (the common case costs one wait on the references, no copy)."""
    refs = [box.ref for segs in pieces.values() for box, _, _ in segs if isinstance(box, InStore)]
    if not refs:
        return []
    dead: set[int] = set()
    for segs in pieces.values():
        row = 0
        for box, start, stop in segs:
            if isinstance(box, InStore) and _lost(box.ref):
                dead.update(range(row, row + stop - start))
            row += stop - start
    return sorted(dead)


def _lost(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=30.0)
    except LOST:
        return True
    return False
