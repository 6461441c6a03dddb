"""``page_cache_bytes``: synced data further behind a partition's head than the window leaves the
page cache (the log recycles memory instead of filling the machine's cache), what is within it
stays, unsynced data is never dropped, and everything still reads back. Residency is asked of
the kernel with ``mincore`` on a mapping of the segment file."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import MiB
from headwater.bus.records import Message

OpenLog = Callable[..., EmbeddedBus]
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident(path: Path) -> list[bool]:
    """Which pages of the file are in the page cache (``mincore``)."""
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    # a private mapping that is never written: its pages are the file's page cache pages
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * pages)()
        failed = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
        del start  # (the mapping cannot close while a ctypes object exports it)
        if failed:
            raise OSError(ctypes.get_errno(), "mincore failed")
    return [bool(v & 1) for v in vec]


def fill(bus: EmbeddedBus, megabytes: int) -> None:
    value = os.urandom(1000)
    for _ in range(megabytes):
        bus.append("t", [Message(value) for _ in range(1000)]).result(timeout=30)


def segment_file(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "log").rglob("*.log")
    return path


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_synced_data_behind_the_window_leaves_the_page_cache(
    open_log: OpenLog, tmp_path: Path
) -> None:
    bus = open_log(durability="always", default_partitions=1, page_cache_bytes=4 * MiB)
    bus.create_topic("t")
    fill(bus, 40)
    bus.flush()  # (the log drops a round's pages after telling its appenders: wait for it)
    pages = resident(segment_file(tmp_path))
    head = len(pages) - (4 * MiB) // PAGE
    # everything before the window (less one drop step and an alignment) has left the cache
    assert not any(pages[: head - (9 * MiB) // PAGE])
    # the window itself is still cached
    assert all(pages[head:])
    # and every record still reads back, from the disk where it was dropped
    records = bus.read("t", 0, 0, max_records=100_000)
    assert len(records) == 40_000
    assert [r.offset for r in records] == list(range(40_000))


def test_zero_keeps_everything_cached(open_log: OpenLog, tmp_path: Path) -> None:
    bus = open_log(durability="always", default_partitions=1, page_cache_bytes=0)
    bus.create_topic("t")
    fill(bus, 20)
    assert all(resident(segment_file(tmp_path)))


def test_unsynced_data_is_never_dropped(open_log: OpenLog, tmp_path: Path) -> None:
    bus = open_log(durability="never", default_partitions=1, page_cache_bytes=1 * MiB)
    bus.create_topic("t")
    fill(bus, 20)
    assert all(resident(segment_file(tmp_path)))
