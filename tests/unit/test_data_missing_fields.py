"""A get of a field nobody wrote: refused by name with a schema, named in the timeout without one."""

from __future__ import annotations

import numpy as np
import pytest

from relax_agent.data import DataConfig, FieldSpec, build_transfer_queue
from relax_agent.errors import DataError, QueueTimeoutError


def make_tq(schema=None):
    tq = build_transfer_queue(DataConfig())
    tq.create_partition("p", 8, schema, group_size=2)
    tq.put("p", ["a", "b"], {"response_ids": [np.arange(3), np.arange(2)]}, group_ids=["g", "g"], versions=[0, 0])
    return tq


def test_get_of_a_field_outside_the_schema_is_refused_at_once_by_name():
    tq = make_tq({"response_ids": FieldSpec("int64", ragged=True), "reward": FieldSpec("float32")})
    with pytest.raises(DataError, match=r"unknown field\(s\) \['nope'\]"):
        tq.get("p", ["response_ids", "nope"], consumer="t", batch_size=2)  # no timeout: would wait forever


def test_get_timeout_without_schema_names_the_fields_no_row_has_yet():
    tq = make_tq()
    with pytest.raises(QueueTimeoutError, match=r"no row has field\(s\) \['nope'\] yet") as err:
        tq.get("p", ["response_ids", "nope"], consumer="t", batch_size=2, timeout_s=0.05)
    assert "fields written so far: ['response_ids']" in str(err.value)


def test_get_timeout_with_every_field_present_says_how_many_rows_are_ready():
    tq = make_tq()
    with pytest.raises(QueueTimeoutError, match=r"2 of batch_size=4 rows have all fields and are free for 't'"):
        tq.get("p", ["response_ids"], consumer="t", batch_size=4, timeout_s=0.05)
