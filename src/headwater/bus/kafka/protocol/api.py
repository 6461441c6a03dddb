"""The requests headwater's producer sends and their responses, in non-flexible versions.

Every request is framed as ``size int32 | request header v1 | body`` and answered by
``size int32 | correlationId int32 | body``. Versions: ApiVersions v0 (what any broker answers
first), Metadata v7, InitProducerId v1, Produce v3-v8 (the highest the broker serves).
A request is returned as a list of byte pieces, so that a batch's bytes are written as they are
(``transport.writelines``), never copied into one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headwater.bus.kafka.protocol.codec import (
    INT16,
    INT32,
    ProtocolError,
    Reader,
    array,
    string,
)

API_PRODUCE = 0
API_METADATA = 3
API_VERSIONS = 18
API_INIT_PRODUCER_ID = 22
NAMES = {
    API_PRODUCE: "Produce",
    API_METADATA: "Metadata",
    API_VERSIONS: "ApiVersions",
    API_INIT_PRODUCER_ID: "InitProducerId",
}
# The versions this module speaks: (lowest, highest) per API.
SPOKEN = {
    API_PRODUCE: (3, 8),
    API_METADATA: (7, 7),
    API_VERSIONS: (0, 0),
    API_INIT_PRODUCER_ID: (1, 1),
}
_HEADER = INT16.size * 2 + INT32.size


def frame(
    api_key: int, version: int, correlation_id: int, client_id: str, body: list[bytes]
) -> list[bytes]:
    """``body`` framed with its size and a request header v1."""
    head = (
        INT16.pack(api_key) + INT16.pack(version) + INT32.pack(correlation_id) + string(client_id)
    )
    size = len(head) + sum(map(len, body))
    return [INT32.pack(size) + head, *body]


def choose_version(api_key: int, served: dict[int, tuple[int, int]]) -> int:
    """The highest version of ``api_key`` both sides speak, or ``UnsupportedBroker``."""
    ours = SPOKEN[api_key]
    theirs = served.get(api_key)
    if theirs is None or theirs[1] < ours[0] or theirs[0] > ours[1]:
        raise UnsupportedBroker(
            f"the broker serves {NAMES[api_key]} "
            f"{'not at all' if theirs is None else f'versions {theirs[0]}-{theirs[1]}'}; "
            f"headwater's producer speaks {ours[0]}-{ours[1]} (Kafka 2.1 or later)"
        )
    return min(ours[1], theirs[1])


class UnsupportedBroker(ProtocolError):
    """The broker serves none of the versions the producer speaks."""


# -- ApiVersions ------------------------------------------------------------------------------
def api_versions_request() -> list[bytes]:
    return []


def api_versions_response(body: bytes) -> tuple[int, dict[int, tuple[int, int]]]:
    """(error code, {api key: (min, max)})."""
    r = Reader(body, "ApiVersionsResponse v0")
    error = r.int16()
    served = r.array(lambda r: (r.int16(), r.int16(), r.int16()))
    return error, {key: (lo, hi) for key, lo, hi in served}


# -- Metadata v7 ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PartitionMeta:
    error: int
    index: int
    leader: int
    leader_epoch: int
    replicas: list[int]
    isr: list[int]


@dataclass(frozen=True, slots=True)
class TopicMeta:
    error: int
    name: str
    partitions: list[PartitionMeta]


@dataclass(frozen=True, slots=True)
class Metadata:
    brokers: dict[int, tuple[str, int]]  # node id -> (host, port)
    topics: dict[str, TopicMeta] = field(default_factory=dict)


def metadata_request(topics: list[str] | None, allow_auto_create: bool = False) -> list[bytes]:
    names = None if topics is None else [string(t) for t in topics]
    return [array(names), b"\x01" if allow_auto_create else b"\x00"]


def _partition(r: Reader) -> PartitionMeta:
    error, index, leader, epoch = r.int16(), r.int32(), r.int32(), r.int32()
    replicas, isr = r.int32_array(), r.int32_array()
    r.int32_array()  # offline replicas
    return PartitionMeta(error, index, leader, epoch, replicas, isr)


def _topic(r: Reader) -> TopicMeta:
    error, name = r.int16(), r.string()
    r.boolean()  # is internal
    return TopicMeta(error, name, r.array(_partition))


def metadata_response(body: bytes) -> Metadata:
    r = Reader(body, "MetadataResponse v7")
    r.int32()  # throttle time
    brokers = r.array(lambda r: (r.int32(), r.string(), r.int32(), r.nullable_string()))
    r.nullable_string()  # cluster id
    r.int32()  # controller id
    topics = r.array(_topic)
    r.end()
    return Metadata({b[0]: (b[1], b[2]) for b in brokers}, {t.name: t for t in topics})


# -- InitProducerId v1 ------------------------------------------------------------------------
def init_producer_id_request() -> list[bytes]:
    """An idempotent (not transactional) producer's id."""
    return [string(None), INT32.pack(-1)]


def init_producer_id_response(body: bytes) -> tuple[int, int, int]:
    """(error code, producer id, epoch)."""
    r = Reader(body, "InitProducerIdResponse v1")
    r.int32()  # throttle time
    error, pid, epoch = r.int16(), r.int64(), r.int16()
    r.end()
    return error, pid, epoch


# -- Produce v3-v8 ----------------------------------------------------------------------------
# One record batch per partition (the broker refuses more than one from v3 on).
ProduceData = dict[str, list[tuple[int, list[bytes]]]]  # topic -> [(partition, batch pieces)]


def produce_request(acks: int, timeout_ms: int, data: ProduceData) -> list[bytes]:
    out = [string(None) + INT16.pack(acks) + INT32.pack(timeout_ms) + INT32.pack(len(data))]
    for topic, partitions in data.items():
        out.append(string(topic) + INT32.pack(len(partitions)))
        for index, pieces in partitions:
            out.append(INT32.pack(index) + INT32.pack(sum(map(len, pieces))))
            out += pieces
    return out


@dataclass(frozen=True, slots=True)
class PartitionResult:
    index: int
    error: int
    base_offset: int
    message: str | None = None  # v8: the broker's words, and the records it blamed


def produce_response(body: bytes, version: int) -> dict[str, list[PartitionResult]]:
    r = Reader(body, f"ProduceResponse v{version}")

    def partition(r: Reader) -> PartitionResult:
        index, error, base = r.int32(), r.int16(), r.int64()
        r.int64()  # log append time
        if version >= 5:
            r.int64()  # log start offset
        message = None
        if version >= 8:
            blamed = r.array(lambda r: (r.int32(), r.nullable_string()))
            message = r.nullable_string()
            if blamed:
                message = (message or "") + "; " + ", ".join(f"record {i}: {m}" for i, m in blamed)
        return PartitionResult(index, error, base, message)

    topics = r.array(lambda r: (r.string(), r.array(partition)))
    r.int32()  # throttle time
    r.end()
    return dict(topics)
