"""The frames between the collector's intake workers and the process that holds the log.

One Unix socket pair per worker carries, little-endian::

    frame   length u32 (of what follows) | kind u8 | id u32 | payload

Worker to host:
    APPEND      batches u16, then per batch: BATCH struct, topic (UTF-8), and the body inline
                unless BATCH says where it is in the worker's shared ring (``collector.ring``):
                the batches of one request, already encoded in the log's columnar format;
                queued all or none
    CONN_OPEN   identity (UTF-8): count a WebSocket connection against the shared limits
    CONN_CLOSE  identity (UTF-8): release it (no answer)
    CALL        JSON ``{"op": ...}``: topic partitions, readiness, merged metrics
    SNAPSHOT    JSON: this worker's metric samples (the answer to ASK)
    READY       the worker serves its ports (no answer)

Host to worker:
    RESULT      status u8, then bases (u16 count, i64 each) for APPEND, JSON for CALL,
                or an error (ERROR_* status, UTF-8 message; for CONN_OPEN a JSON refusal)
    ASK         send a SNAPSHOT with this id
    NOTICE      JSON state every worker must know (the admission refusal)

Between two workers, on the socket one opened to the other (``collector.sharing``), the same
frames:
    HAND        a gRPC call (``call_payload``) for the other worker to serve
    TAKEN       its answer (the same id): status u8 (OK, DECLINED: not started, ERROR_FAILED),
                the serving worker's calls in progress u16, then the call's response message
                (for ERROR_FAILED: why, UTF-8)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from headwater.bus.embedded import format as fmt
from headwater.collector.errors import Code, Rejected

HEAD = struct.Struct("<IBI")
HEAD_SIZE = HEAD.size
# topic_len, partition (-1: the next in turn), count, last_offset_delta, first_ts, max_ts,
# body_crc, body_len, ring position of the body (-1: inline, after the topic)
BATCH = struct.Struct("<HiIIqqIIq")
COUNT = struct.Struct("<H")
BASE = struct.Struct("<q")

APPEND, CONN_OPEN, CONN_CLOSE, CALL, SNAPSHOT, READY = 1, 2, 3, 4, 5, 6
RESULT, ASK, NOTICE = 16, 17, 18
HAND, TAKEN = 32, 33

OK, ERROR_UNAVAILABLE, ERROR_INVALID, ERROR_REFUSED, ERROR_FAILED, DECLINED = 0, 1, 2, 3, 4, 5
CALL_HEAD = struct.Struct("<I")  # the length of a handed call's JSON part
TAKEN_HEAD = struct.Struct("<BH")  # status, the helper's active calls

MAX_FRAME = 1 << 30


def frame(kind: int, ident: int, *payload: bytes | memoryview) -> bytes:
    size = HEAD_SIZE - 4 + sum(len(p) for p in payload)
    return b"".join((HEAD.pack(size, kind, ident), *payload))


def json_frame(kind: int, ident: int, doc: Any) -> bytes:
    return frame(kind, ident, json.dumps(doc, separators=(",", ":")).encode())


def append_frame(
    ident: int,
    batches: Sequence[tuple[str, int | None, fmt.EncodedBatch]],
    at: Sequence[int | None],
) -> list[bytes]:
    """The parts of an APPEND frame (written together; bodies in the ring, at ``at``, are not
    sent, the others are not copied here)."""
    parts: list[bytes] = [b"", COUNT.pack(len(batches))]
    size = HEAD_SIZE - 4 + 2
    for (topic, partition, b), position in zip(batches, at, strict=True):
        name = topic.encode()
        head = BATCH.pack(
            len(name),
            -1 if partition is None else partition,
            b.count,
            b.last_offset_delta,
            b.first_timestamp,
            b.max_timestamp,
            b.body_crc,
            len(b.body),
            -1 if position is None else position,
        )
        if position is None:
            parts += (head, name, b.body)  # type: ignore[arg-type]
            size += len(head) + len(name) + len(b.body)
        else:
            parts += (head, name)
            size += len(head) + len(name)
    parts[0] = HEAD.pack(size, APPEND, ident)
    return parts


def read_append(
    payload: memoryview, ring: memoryview | None
) -> list[tuple[str, int | None, fmt.EncodedBatch]]:
    """The batches of an APPEND payload; bodies are views of the frame or of the worker's
    ``ring`` (no copy)."""
    (n,) = COUNT.unpack_from(payload, 0)
    pos = COUNT.size
    out: list[tuple[str, int | None, fmt.EncodedBatch]] = []
    for _ in range(n):
        tlen, partition, count, last, first_ts, max_ts, crc, blen, at = BATCH.unpack_from(
            payload, pos
        )
        pos += BATCH.size
        topic = bytes(payload[pos : pos + tlen]).decode()
        pos += tlen
        if at < 0:
            body = payload[pos : pos + blen]
            pos += blen
        elif ring is not None:
            body = ring[at : at + blen]
        else:
            raise ValueError("a batch in a ring this link does not have")
        if len(body) != blen or count < 1:
            raise ValueError(f"a malformed batch for {topic!r} in an APPEND frame")
        batch = fmt.EncodedBatch(body, crc, count, last, first_ts, max_ts)  # type: ignore[arg-type]
        out.append((topic, None if partition < 0 else partition, batch))
    return out


def call_payload(message: bytes, metadata: Mapping[str, str], peer: str) -> list[bytes]:
    """A HAND payload's parts: a gRPC call's metadata and peer (JSON), then its message."""
    doc = json.dumps({"m": dict(metadata), "p": peer}, separators=(",", ":")).encode()
    return [CALL_HEAD.pack(len(doc)), doc, message]


def read_call(payload: memoryview) -> tuple[bytes, dict[str, str], str]:
    """A HAND payload: the call's message, metadata and peer."""
    (n,) = CALL_HEAD.unpack_from(payload, 0)
    start = CALL_HEAD.size + n
    if start > len(payload):
        raise ValueError("a handed call cut off in its metadata")
    doc = json.loads(bytes(payload[CALL_HEAD.size : start]))
    return bytes(payload[start:]), doc["m"], doc["p"]


def taken_payload(status: int, active: int, response: bytes = b"") -> bytes:
    return TAKEN_HEAD.pack(status, min(active, 0xFFFF)) + response


def read_taken(payload: memoryview) -> tuple[int, int, bytes]:
    """A TAKEN payload: its status, the serving worker's calls, the response message."""
    status, active = TAKEN_HEAD.unpack_from(payload, 0)
    return status, active, bytes(payload[TAKEN_HEAD.size :])


def bases_payload(bases: Sequence[int]) -> bytes:
    return b"".join((bytes((OK,)), COUNT.pack(len(bases)), *map(BASE.pack, bases)))


def read_bases(payload: memoryview) -> list[int]:
    (n,) = COUNT.unpack_from(payload, 1)
    return [BASE.unpack_from(payload, 3 + 8 * i)[0] for i in range(n)]


def error_payload(status: int, message: str) -> bytes:
    return bytes((status,)) + message.encode()


def refusal_payload(e: Rejected) -> bytes:
    doc = {
        "reason": e.reason,
        "status": e.status,
        "code": int(e.code),
        "retry_after": e.retry_after,
        "kind": e.kind,
    }
    return bytes((ERROR_REFUSED,)) + json.dumps(doc).encode()


def read_refusal(payload: memoryview) -> Rejected:
    doc = json.loads(bytes(payload[1:]))
    return Rejected(
        doc["reason"],
        status=doc["status"],
        code=Code(doc["code"]),
        retry_after=doc["retry_after"],
        kind=doc["kind"],
    )


class Frames:
    """Splits a byte stream into frames: ``feed`` returns the complete ones as
    ``(kind, id, payload view)`` (views of immutable bytes: safe to keep)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[tuple[int, int, memoryview]]:
        buf = self._rest + data if self._rest else data
        out: list[tuple[int, int, memoryview]] = []
        pos, end = 0, len(buf)
        view = memoryview(buf)
        while end - pos >= HEAD_SIZE:
            size, kind, ident = HEAD.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes is larger than any the peer sends")
            stop = pos + 4 + size
            if stop > end:
                break
            out.append((kind, ident, view[pos + HEAD_SIZE : stop]))
            pos = stop
        self._rest = bytes(view[pos:]) if pos < end else b""
        return out
