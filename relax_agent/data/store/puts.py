"""A put: validated against the current state without changing it (:meth:`Puts.plan_put`), then
applied whole (:meth:`Puts.commit_put`) once its new rows fit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relax_agent.data.schema import FieldSpec, make_chunk
from relax_agent.data.store.checks import check_ids, check_ref, check_versions
from relax_agent.data.store.state import Partition, PutPlan, RefField, Row, Stored, StoreState
from relax_agent.errors import DataError


class Puts(StoreState):
    """:class:`~relax_agent.data.store.Store`'s puts."""

    def plan_put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        fields: Mapping[str, Any],
        group_ids: Sequence[str] | None = None,
        versions: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> PutPlan:
        """Validate a put against the current state without changing it.

        Raises:
            DataError: see :meth:`relax_agent.data.TransferQueue.put`.
        """
        part = self._partition(partition)
        ids = check_ids(partition, "sample_ids", sample_ids)
        if group_ids is not None:
            group_ids = check_ids(partition, "group_ids", group_ids)
        if len(set(ids)) != len(ids):
            dup = next(s for s in ids if ids.count(s) > 1)
            raise DataError(f"partition {partition!r}: sample id {dup!r} appears twice in one put")
        creating = group_ids is not None or versions is not None
        new = self._check_ids(part, ids, group_ids, versions, creating)
        if not fields and not creating:
            raise DataError(f"partition {partition!r}: a put needs fields or new rows")
        if part.capacity_rows < sum(new):
            raise DataError(f"partition {partition!r}: a put of {sum(new)} new rows can never fit "
                            f"capacity_rows={part.capacity_rows}")
        chunks = {name: self._chunk(part, name, values, ids) for name, values in fields.items()}
        if not overwrite:
            for name in chunks:
                for sid, is_new in zip(ids, new, strict=True):
                    if not is_new and name in part.rows[sid].values:
                        raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r} is already "
                                        "written (pass overwrite=True to replace it)")
        return PutPlan(part, ids, new, chunks, group_ids, versions)

    def _check_ids(self, part: Partition, ids: list[str], group_ids: Sequence[str] | None,
                   versions: Sequence[int] | None, creating: bool) -> list[bool]:
        if creating:
            if group_ids is None or versions is None:
                raise DataError(f"partition {part.name!r}: new rows need both group_ids and versions")
            if len(group_ids) != len(ids) or len(versions) != len(ids):
                raise DataError(f"partition {part.name!r}: {len(ids)} sample ids but {len(group_ids)} group_ids "
                                f"and {len(versions)} versions")
            versions = check_versions(part.name, versions)
            for sid in ids:
                if sid in part.rows or sid in part.retired or sid in part.dead:
                    raise DataError(f"partition {part.name!r}: duplicate sample id {sid!r} (a row with that id "
                                    "exists; to add fields to it, put without group_ids/versions)")
                if sid in part.cleared:
                    raise DataError(f"partition {part.name!r}: duplicate sample id {sid!r}: a row with that id was "
                                    "stored before a clear(), and a reader may still hold it; use a new id")
            if part.group_size is not None:
                self._check_groups(part, list(group_ids), versions)
            return [True] * len(ids)
        for sid in ids:
            if sid not in part.rows:
                gone = " (already consumed and retired)" if sid in part.retired else ""
                raise DataError(f"partition {part.name!r}: unknown sample id {sid!r}{gone}; new rows need "
                                "group_ids and versions")
        return [False] * len(ids)

    def _check_groups(self, part: Partition, group_ids: list[str], versions: list[int]) -> None:
        """A partition with ``group_size`` holds each group as at most ``group_size`` live rows of one
        policy version: a surplus row could never be handed out by the group sampler, and a group
        of mixed versions has no single version to train on."""
        live = {gid: part.groups[gid] for gid in group_ids if gid in part.groups}
        for gid, version in zip(group_ids, versions, strict=True):
            have, count = live.get(gid, (version, 0))
            if have != version:
                raise DataError(f"partition {part.name!r}: group {gid!r} holds rows of policy version {have}; "
                                f"a row of version {version} cannot join it (one group, one version)")
            if count == part.group_size:
                raise DataError(f"partition {part.name!r}: group {gid!r} already has group_size={part.group_size} "
                                "rows; a surplus row would never be handed out by the group sampler")
            live[gid] = (version, count + 1)

    def _chunk(self, part: Partition, name: str, values: Any, ids: list[str]) -> tuple[Stored, FieldSpec, list[int]]:
        spec = part.schema.get(name)
        if spec is None and part.fixed_schema:
            raise DataError(f"partition {part.name!r}: unknown field {name!r}; the schema has {sorted(part.schema)}")
        if isinstance(values, RefField):
            spec, lengths = check_ref(part.name, name, values, ids, spec)
            return Stored(values.ref, is_ref=True), spec, lengths
        chunk = make_chunk(name, values, ids, spec)
        return Stored(chunk.values), chunk.spec, chunk.lengths

    def commit_put(self, plan: PutPlan) -> None:
        """Apply a plan from :meth:`plan_put` (the caller made sure the new rows fit)."""
        part = plan.partition
        assert part.capacity_rows - len(part.rows) >= plan.new_rows
        for name, (_, spec, _) in plan.chunks.items():
            part.schema.setdefault(name, spec)
        for i, (sid, is_new) in enumerate(zip(plan.sample_ids, plan.new, strict=True)):
            if is_new:
                assert plan.group_ids is not None and plan.versions is not None  # _check_ids requires both for new rows
                row = Row(len(part.order), str(plan.group_ids[i]), int(plan.versions[i]))
                part.rows[sid] = row
                part.groups[row.group_id] = (row.version, part.groups.get(row.group_id, (0, 0))[1] + 1)
                part.order.append(sid)
            row = part.rows[sid]
            for name, (stored, _, lengths) in plan.chunks.items():
                row.values[name] = (stored, i)
                row.lengths[name] = lengths[i]
        part.put_rows += plan.new_rows
