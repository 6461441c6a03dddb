"""The pseudonyms' digests: RFC 2104 HMAC-SHA256 for every key length, nulls kept, the cache."""

from __future__ import annotations

import hashlib
import hmac

import pyarrow as pa
import pytest

from headwater.pipeline.steps import pseudonyms
from headwater.pipeline.steps.pseudonyms import Pseudonyms


@pytest.mark.parametrize("key", [b"k", b"x" * 64, b"long key " * 20])  # short, a block, hashed
def test_digests_are_hmac_sha256_of_the_text(key: bytes) -> None:
    values = pa.array(["u-1", None, "ünïcode", "u-1", ""])
    got = Pseudonyms(key).of(values).to_pylist()
    want = [hmac.new(key, v.encode(), hashlib.sha256).hexdigest() for v in ("u-1", "ünïcode")]
    assert got == [want[0], None, want[1], want[0], hmac.new(key, b"", "sha256").hexdigest()]


def test_the_cache_starts_again_when_full_and_answers_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pseudonyms, "CACHE_MAX", 3)
    p = Pseudonyms(b"key")
    first = p.of(pa.chunked_array([["a", "b"], ["c", "d", "a"]])).to_pylist()
    assert len(p.cache(0)) <= 3
    assert p.of(pa.array(["a", "b", "c", "d"])).to_pylist() == first[:4]
    assert first[4] == first[0]
    assert p.of(pa.array(["a"]), 1).to_pylist() == first[:1]  # another field: its own cache
    assert list(p.cache(1)) == ["a"]
