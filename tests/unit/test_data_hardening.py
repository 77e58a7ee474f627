"""Data bus, bad input that used to be stored wrongly (issue 17): inferred dtypes of empty rows,
floats that overflow the field, ids that collide after ``str()``, groups the group sampler
could never hand out or that mixed policy versions."""

from __future__ import annotations

import numpy as np
import pytest

from relax_agent.data import DataConfig, FieldSpec, GroupSampler, build_transfer_queue
from relax_agent.errors import DataError


@pytest.fixture
def tq():
    return build_transfer_queue(DataConfig())


def test_an_empty_first_row_does_not_make_token_ids_float(tq):
    tq.create_partition("p", 8)
    tq.put("p", ["a", "b"], {"response_ids": [[], [5, 6]]}, group_ids=["g", "g"], versions=[0, 0])
    assert tq.stats("p")["fields"]["response_ids"] == "int64[*]"
    rows = tq.get("p", ["response_ids"], "c", 2).fields["response_ids"]
    assert [r.dtype for r in rows] == [np.int64, np.int64] and rows[1].tolist() == [5, 6]


def test_a_field_of_only_empty_lists_is_refused_naming_it(tq):
    tq.create_partition("p", 8)
    with pytest.raises(DataError, match=r"field 'response_ids'.*empty list.*no dtype"):
        tq.put("p", ["a"], {"response_ids": [[]]}, group_ids=["g"], versions=[0])
    assert tq.stats("p")["rows"] == 0  # nothing stored, the field's spec is not fixed either
    tq.put("p", ["a"], {"response_ids": [np.array([], dtype=np.int32)]}, group_ids=["g"], versions=[0])
    assert tq.stats("p")["fields"]["response_ids"] == "int32[*]"


@pytest.mark.parametrize("dtype,value", [("float32", 1e39), ("float16", 70000.0), ("float32", [1.0, -3e39])])
def test_a_float_that_overflows_the_field_dtype_is_refused_not_stored_as_inf(tq, dtype, value):
    ragged = isinstance(value, list)
    tq.create_partition("p", 8, {"x": FieldSpec(dtype, ragged=ragged)})
    with pytest.raises(DataError, match=rf"field 'x' of sample 'a'.*overflows the partition's {dtype}"):
        tq.put("p", ["a"], {"x": [value]}, group_ids=["g"], versions=[0])
    assert tq.stats("p")["rows"] == 0
    tq.put("p", ["a"], {"x": [[1.0, float("inf")] if ragged else float("inf")]}, group_ids=["g"], versions=[0])
    assert tq.stats("p")["rows"] == 1  # an inf that is already inf is the caller's value, kept as given


@pytest.mark.parametrize("ids,match", [
    ([1], r"sample_ids\[0\]=1 \(int\)"),
    (["1", 2], r"sample_ids\[1\]=2 \(int\)"),
    ("abc", r"sample_ids='abc' \(str\) is not a sequence"),
])
def test_sample_ids_that_are_not_strings_are_refused(tq, ids, match):
    tq.create_partition("p", 8)
    n = 3 if isinstance(ids, str) else len(ids)
    with pytest.raises(DataError, match=match):
        tq.put("p", ids, {"r": [1.0] * n}, group_ids=["g"] * n, versions=[0] * n)
    assert tq.stats("p")["rows"] == 0


def test_int_and_str_ids_no_longer_name_the_same_row(tq):
    tq.create_partition("p", 8)
    tq.put("p", ["1"], {"r": [1.0]}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match=r"sample_ids\[0\]=1 \(int\)"):
        tq.put("p", [1], {"s": [2.0]})  # used to add a field to row "1"
    with pytest.raises(DataError, match=r"group_ids='g0' \(str\) is not a sequence"):
        tq.put("p", ["a", "b", "c"], {"r": [1.0] * 3}, group_ids="g0", versions=[0] * 3)


def test_a_group_never_gets_more_rows_than_group_size(tq):
    tq.create_partition("p", 8, group_size=2)
    tq.put("p", ["a", "b"], {"r": [1.0, 2.0]}, group_ids=["g", "g"], versions=[0, 0])
    with pytest.raises(DataError, match=r"group 'g' already has group_size=2 rows"):
        tq.put("p", ["c"], {"r": [3.0]}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match=r"group 'h' already has group_size=2"):
        tq.put("p", ["x", "y", "z"], {"r": [1.0] * 3}, group_ids=["h"] * 3, versions=[0] * 3)
    assert tq.stats("p")["rows"] == 2
    assert tq.get("p", ["r"], "c", 2, timeout_s=5, sampler="group").sample_ids == ["a", "b"]


def test_a_group_holds_one_policy_version(tq):
    tq.create_partition("p", 8, group_size=2)
    tq.put("p", ["a"], {"r": [1.0]}, group_ids=["g"], versions=[3])
    with pytest.raises(DataError, match=r"group 'g' holds rows of policy version 3; a row of version 4"):
        tq.put("p", ["b"], {"r": [2.0]}, group_ids=["g"], versions=[4])


def test_a_retired_group_id_can_be_used_again(tq):
    tq.create_partition("p", 8, group_size=2, retire_after=["c"])
    tq.put("p", ["a", "b"], {"r": [1.0, 2.0]}, group_ids=["g", "g"], versions=[0, 0])
    tq.ack(tq.get("p", ["r"], "c", 2, timeout_s=5, sampler="group").lease_id)
    tq.put("p", ["c", "d"], {"r": [1.0, 2.0]}, group_ids=["g", "g"], versions=[1, 1])
    batch = tq.get("p", ["r"], "c", 2, timeout_s=5, sampler="group")
    assert batch.sample_ids == ["c", "d"] and batch.versions == [1, 1]


def test_the_group_sampler_neither_orphans_surplus_rows_nor_mixes_versions(tq):
    # a partition without group_size: the store cannot check groups, the sampler must cope
    tq.create_partition("p", 16)
    rows = [("a", "g", 0), ("b", "g", 1), ("c", "g", 0), ("d", "g", 0), ("e", "g", 1), ("f", "g", 0)]
    for sid, gid, version in rows:
        tq.put("p", [sid], {"r": [0.0]}, group_ids=[gid], versions=[version])
    sampler = GroupSampler(2)
    got = [tq.get("p", ["r"], "c", 2, timeout_s=5, sampler=sampler) for _ in range(3)]
    assert [(b.sample_ids, b.versions) for b in got] == [
        (["a", "c"], [0, 0]), (["b", "e"], [1, 1]), (["d", "f"], [0, 0])]


def test_the_group_sampler_hands_out_two_groups_of_one_group_id_in_one_batch(tq):
    tq.create_partition("p", 16)
    tq.put("p", list("abcd"), {"r": [0.0] * 4}, group_ids=["g"] * 4, versions=[0] * 4)
    batch = tq.get("p", ["r"], "c", 4, timeout_s=5, sampler=GroupSampler(2))  # used to wait forever
    assert batch.sample_ids == list("abcd")
