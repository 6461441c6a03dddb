"""gzip_compress: ISA-L at levels 1-3, zlib above; standard gzip either way."""

from __future__ import annotations

import gzip
import zlib

import pytest

from headwater.http.compression import gzip_compress

EVENTS = b"".join(
    b'{"event":"page_view","user_id":"u%d","page":"/p/%d","n":%d}\n' % (i % 997, i % 89, i)
    for i in range(5000)
)


@pytest.mark.parametrize("level", range(1, 10))
def test_every_level_writes_gzip_that_the_standard_library_reads(level: int) -> None:
    body = gzip_compress(EVENTS, level, mtime=0)
    assert body[:2] == b"\x1f\x8b"
    assert gzip.decompress(body) == EVENTS
    assert zlib.decompress(body, wbits=31) == EVENTS


def test_level_one_is_isal_and_no_larger_than_zlib() -> None:
    ours = gzip_compress(EVENTS, 1, mtime=0)
    zlibs = gzip.compress(EVENTS, compresslevel=1, mtime=0)
    assert ours != zlibs  # another deflate than zlib's
    assert len(ours) <= len(zlibs) * 1.05


def test_a_fixed_mtime_gives_the_same_bytes() -> None:
    assert gzip_compress(EVENTS, 1, mtime=0) == gzip_compress(EVENTS, 1, mtime=0)
    assert gzip_compress(EVENTS, 6, mtime=0) == gzip.compress(EVENTS, compresslevel=6, mtime=0)


@pytest.mark.parametrize("level", [0, 10, -1])
def test_a_level_outside_one_to_nine_is_refused(level: int) -> None:
    with pytest.raises(ValueError, match="1 to 9"):
        gzip_compress(EVENTS, level)
