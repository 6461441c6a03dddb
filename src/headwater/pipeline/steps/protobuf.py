"""Protobuf payloads for step 1 (decode): the value bytes of an event type with a registered
message type (``pipeline.protobuf``) become the message's canonical JSON.

Spark's ``from_protobuf`` needs the spark-protobuf jar, which headwater cannot assume on the
classpath, so this is an Arrow UDF over ``google.protobuf``. The driver reads and checks each
descriptor set once (a bad file or an unknown message is a configuration error, reported before
any event is read) and ships its bytes inside the UDF, so workers need no access to the files;
each worker builds a message class once per (descriptor set, message) and keeps it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from headwater.errors import ConfigError

if TYPE_CHECKING:
    from headwater.pipeline.config import ProtobufType

PROTOBUF_SCHEMA = StructType(
    [StructField("json", StringType()), StructField("error", StringType())]
)
_ARROW_TYPE = pa.struct([("json", pa.string()), ("error", pa.string())])
# Files protoc leaves out of a descriptor set unless told --include_imports.
_WELL_KNOWN = (
    "any_pb2",
    "duration_pb2",
    "empty_pb2",
    "field_mask_pb2",
    "struct_pb2",
    "timestamp_pb2",
    "wrappers_pb2",
)


class ProtobufConfigError(ConfigError):
    """A registered protobuf type cannot be used: its descriptor set is missing or invalid, or
    does not define the message."""

    code = "HW-PIPE-104"


@dataclass(frozen=True)
class MessageType:
    """What a worker needs to decode one event type: a descriptor set's bytes and a message."""

    digest: str
    descriptor_set: bytes
    message: str


def load_types(types: Mapping[str, ProtobufType]) -> dict[str, MessageType]:
    """Read and check every registered type's descriptor set (driver side)."""
    loaded: dict[str, MessageType] = {}
    for event_type, spec in types.items():
        try:
            data = spec.descriptor_set.read_bytes()
        except OSError as exc:
            raise ProtobufConfigError(
                f"pipeline.protobuf.{event_type}.descriptor_set: cannot read "
                f"{spec.descriptor_set}: {exc.strerror or exc}"
            ) from exc
        found = MessageType(hashlib.sha256(data).hexdigest(), data, spec.message)
        try:
            message_class(found)
        except Exception as exc:  # protobuf raises assorted types for a bad set or name
            raise ProtobufConfigError(
                f"pipeline.protobuf.{event_type}: {spec.descriptor_set} does not give message "
                f"{spec.message!r}: {exc}"
            ) from exc
        loaded[event_type] = found
    return loaded


_CLASSES: dict[tuple[str, str], tuple[Any, Any]] = {}


def message_class(kind: MessageType) -> tuple[Any, Any]:
    """``(message class, its descriptor pool)`` for ``kind``, built once per process."""
    key = (kind.digest, kind.message)
    if key not in _CLASSES:
        _CLASSES[key] = _build(kind)
    return _CLASSES[key]


def _build(kind: MessageType) -> tuple[Any, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    files = descriptor_pb2.FileDescriptorSet.FromString(kind.descriptor_set).file
    pool = descriptor_pool.DescriptorPool()
    by_name = {f.name: f for f in files}
    added: set[str] = set()

    def add(name: str) -> None:  # dependencies first, as the pool requires
        if name in added:
            return
        added.add(name)
        proto = by_name.get(name) or _well_known(name)
        for dependency in proto.dependency:
            add(dependency)
        pool.Add(proto)

    for name in by_name:
        add(name)
    descriptor = pool.FindMessageTypeByName(kind.message)
    return message_factory.GetMessageClass(descriptor), pool


def _well_known(name: str) -> Any:
    """The FileDescriptorProto of a well-known type's file the set does not include."""
    import importlib

    from google.protobuf import descriptor_pb2, descriptor_pool

    for module in _WELL_KNOWN:
        importlib.import_module(f"google.protobuf.{module}")
    proto = descriptor_pb2.FileDescriptorProto()
    try:
        descriptor_pool.Default().FindFileByName(name).CopyToProto(proto)
    except KeyError as exc:
        raise KeyError(f"the descriptor set lacks {name!r} (protoc --include_imports)") from exc
    return proto


def to_json(kind: MessageType, value: bytes | None) -> tuple[str | None, str | None]:
    """``(json, None)`` for bytes that are a ``kind`` message, else ``(None, reason)``."""
    if value is None:
        return None, f"the event has no value to decode as protobuf message {kind.message}"
    from google.protobuf import json_format

    cls, pool = message_class(kind)
    try:
        message = cls.FromString(value)
        as_dict = json_format.MessageToDict(
            message, preserving_proto_field_name=True, descriptor_pool=pool
        )
    except Exception as exc:  # DecodeError, or a value JSON cannot carry
        return None, f"the value is not a valid protobuf message {kind.message}: {exc}"
    return json.dumps(as_dict, ensure_ascii=False, separators=(",", ":")), None


def protobuf_to_json(
    value_col: Column, type_col: Column, types: Mapping[str, ProtobufType]
) -> Column:
    """``struct<json, error>`` for rows whose ``type_col`` has a registered message type (one of
    the two is set), null for every other row."""
    kinds = load_types(types)
    if not kinds:
        return F.lit(None).cast(PROTOBUF_SCHEMA)

    @F.arrow_udf(PROTOBUF_SCHEMA)  # type: ignore[call-overload]
    def decode(values: pa.Array, event_types: pa.Array) -> pa.Array:
        out: list[dict[str, str | None] | None] = []
        for value, event_type in zip(values.to_pylist(), event_types.to_pylist(), strict=True):
            kind = kinds.get(event_type) if event_type is not None else None
            if kind is None:
                out.append(None)
            else:
                text, error = to_json(kind, value)
                out.append({"json": text, "error": error})
        return pa.array(out, type=_ARROW_TYPE)

    return decode(value_col, type_col)
