"""The trainer hands freed heap memory back to the OS after a step (glibc keeps it otherwise)."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from relax_agent.train.memory import release_free_heap, resident_gb

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_small_allocations_are_returned_to_the_os_by_the_trim():
    assert ctypes.util.find_library("c")
    before = resident_gb()
    # 256 MB in 64 KB blocks: below glibc's mmap threshold, so they live on the heap; one block kept
    # at the end pins the heap's top, so freeing the rest alone cannot shrink it.
    blocks = [bytearray(64 * 1024) for _ in range(4096)]
    keep = bytearray(64 * 1024)
    grown = resident_gb()
    assert grown - before > 0.2
    del blocks
    retained = resident_gb()
    assert release_free_heap() is True
    trimmed = resident_gb()
    assert retained - trimmed > 0.2, (before, grown, retained, trimmed)
    assert len(keep) == 64 * 1024


def test_resident_memory_is_reported_in_gb():
    assert 0.01 < resident_gb() < 1000
