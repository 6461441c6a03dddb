"""Reading HTTP bodies: content codings undone within the size limit, every failure named."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import pytest

from headwater.collector.errors import Rejected
from headwater.collector.protocols.body import decode_body, dump_json, parse_json

MAX = 5 * 1024 * 1024
PAYLOAD = b'{"batch":[{"type":"track","event":"x","userId":"u"}]}' * 20


def _reject(raw: bytes, encoding: str | None, max_bytes: int = MAX) -> Rejected:
    with pytest.raises(Rejected) as info:
        decode_body(raw, encoding, max_bytes)
    return info.value


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def _gzip_bomb(inflated: int) -> bytes:
    """A gzip body that inflates to ``inflated`` zero bytes, built without holding them."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    parts = [c.compress(chunk) for _ in range(inflated >> 20)]
    parts.append(c.compress(bytes(inflated & ((1 << 20) - 1))))
    parts.append(c.flush())
    return b"".join(parts)


@pytest.mark.parametrize("encoding", [None, "", "identity", "Identity", " identity "])
def test_identity_bodies_pass_through(encoding: str | None) -> None:
    assert decode_body(PAYLOAD, encoding, MAX) == PAYLOAD


@pytest.mark.parametrize("encoding", ["gzip", "GZIP", "x-gzip", " gzip ", "identity, gzip"])
def test_gzip_bodies_inflate(encoding: str) -> None:
    assert decode_body(gzip.compress(PAYLOAD), encoding, MAX) == PAYLOAD


def test_several_gzip_members_are_one_body() -> None:
    raw = gzip.compress(PAYLOAD[:100]) + gzip.compress(PAYLOAD[100:])
    assert decode_body(raw, "gzip", MAX) == PAYLOAD


def test_deflate_in_the_zlib_format_and_raw() -> None:
    assert decode_body(zlib.compress(PAYLOAD), "deflate", MAX) == PAYLOAD
    assert decode_body(_deflate_raw(PAYLOAD), "deflate", MAX) == PAYLOAD


def test_stacked_codings_are_undone_last_first() -> None:
    raw = gzip.compress(zlib.compress(PAYLOAD))  # deflate applied first, then gzip
    assert decode_body(raw, "deflate, gzip", MAX) == PAYLOAD


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip;q=1"])
def test_unknown_codings_are_refused_by_name(encoding: str) -> None:
    err = _reject(b"xx", encoding)
    assert err.status == 415
    assert repr(encoding) in err.reason
    assert "gzip, deflate, identity" in err.reason


def test_too_many_stacked_codings() -> None:
    err = _reject(b"xx", "gzip, gzip, gzip")
    assert err.status == 415
    assert "stacks 3 codings" in err.reason


def test_a_body_longer_than_the_limit_is_refused_before_reading_it() -> None:
    err = _reject(b"x" * 101, None, 100)
    assert err.status == 413
    assert err.reason == "body is 101 bytes, more than 100 (collector.limits.max_body_bytes)"


def test_inflating_exactly_to_the_limit_is_fine_one_more_byte_is_not() -> None:
    assert len(decode_body(gzip.compress(bytes(1000)), "gzip", 1000)) == 1000
    err = _reject(gzip.compress(bytes(1001)), "gzip", 1000)
    assert err.status == 413
    assert err.reason == "body inflates past 1000 bytes (collector.limits.max_body_bytes)"


def test_a_gzip_bomb_is_refused_without_inflating_it() -> None:
    bomb = _gzip_bomb(1 << 27)  # 128 MiB of zeros in about 130 kB
    assert len(bomb) < 150_000
    tracemalloc.start()
    try:
        err = _reject(bomb, "gzip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.status == 413
    assert err.reason == "body inflates past 5242880 bytes (collector.limits.max_body_bytes)"
    assert peak < 3 * MAX  # never holds much more than the limit, let alone 128 MiB


def test_a_bomb_split_over_many_gzip_members_is_refused_too() -> None:
    member = _gzip_bomb(1 << 20)
    err = _reject(member * 8, "gzip")
    assert err.reason == "body inflates past 5242880 bytes (collector.limits.max_body_bytes)"


def test_a_deflate_bomb_is_refused() -> None:
    err = _reject(zlib.compress(bytes(MAX + 1), 9), "deflate")
    assert err.status == 413


@pytest.mark.parametrize(
    ("raw", "encoding", "reason"),
    [
        (b"", "gzip", "gzip body is empty"),
        (b"", "deflate", "deflate body is empty"),
        (PAYLOAD, "gzip", "gzip body is corrupt: it does not start with the gzip magic bytes"),
        (gzip.compress(PAYLOAD)[:-12], "gzip", "gzip body is truncated"),
        (gzip.compress(PAYLOAD)[:15], "gzip", "gzip body is truncated"),
        (
            gzip.compress(PAYLOAD) + b"junk",
            "gzip",
            "gzip body is corrupt: 4 bytes of trailing data",
        ),
        (zlib.compress(PAYLOAD) + b"!", "deflate", "deflate body is corrupt: 1 bytes of trailing"),
        (b"\x1f\x8b\x08\x00" + b"\xff" * 40, "gzip", "gzip body is corrupt: Error -3"),
        (b"\xff" * 40, "deflate", "deflate body is corrupt: Error -3"),
        (zlib.compress(PAYLOAD)[:-6], "deflate", "deflate body is truncated"),
    ],
)
def test_corrupt_bodies_are_named(raw: bytes, encoding: str, reason: str) -> None:
    err = _reject(raw, encoding)
    assert err.status == 400
    assert err.reason.startswith(reason), err.reason


def test_a_gzip_body_with_a_wrong_checksum_is_corrupt() -> None:
    raw = bytearray(gzip.compress(PAYLOAD))
    raw[-8] ^= 0xFF  # the CRC-32 of the trailer
    err = _reject(bytes(raw), "gzip")
    assert err.reason.startswith("gzip body is corrupt: Error -3"), err.reason
    assert "incorrect data check" in err.reason


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "body is empty"),
        (b"  \n", "body is empty"),
        (b"{", "body is not valid JSON: "),
        (b'{"a": NaN}', "body is not valid JSON: unexpected character"),
        (b"[Infinity]", "body is not valid JSON: unexpected character"),
        (b"[1e400]", "body is not valid JSON: number is infinity"),
        (b'{"a": "\xff"}', "body is not valid JSON: str is not valid UTF-8"),
        (b"\xef\xbb\xbf{}", "body is not valid JSON: UTF-8 byte order mark"),
        (b"{} {}", "body is not valid JSON: unexpected content after document"),
        (b"[" * 5000 + b"]" * 5000, "body is not valid JSON: depth limit exceeded"),
    ],
)
def test_json_is_parsed_strictly(body: bytes, reason: str) -> None:
    with pytest.raises(Rejected) as info:
        parse_json(body)
    assert info.value.status == 400
    assert info.value.reason.startswith(reason), info.value.reason


def test_json_nested_too_deep_to_write_back_is_refused() -> None:
    deep = parse_json(b"[" * 600 + b"]" * 600)  # orjson reads 1024 levels, writes 254
    with pytest.raises(Rejected, match=r"batch\[0\]: cannot be stored: .*[Rr]ecursion"):
        dump_json(deep, "batch[0]: ")
