"""Protobuf payloads for step 1 (decode): the value bytes of an event type with a registered
message type (``pipeline.protobuf``) become the message's canonical JSON.

The driver reads and checks each descriptor set once (a bad file or an unknown message is a
configuration error, reported before any event is read) and ships its bytes in the batch's
program, so workers need no access to the files; each worker builds a message class once per
(descriptor set, message) and keeps it. The task decodes the registered types' values with
``google.protobuf`` (``decode_values``) before its query runs; the query takes their JSON.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from headwater.errors import ConfigError

if TYPE_CHECKING:
    from headwater.pipeline.config import ProtobufType

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

    def to_json(self) -> dict[str, str]:
        return {
            "digest": self.digest,
            "descriptor_set": base64.b64encode(self.descriptor_set).decode("ascii"),
            "message": self.message,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> MessageType:
        return cls(data["digest"], base64.b64decode(data["descriptor_set"]), data["message"])


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


def decode_values(
    values: pa.Array, event_types: pa.Array, kinds: Mapping[str, MessageType]
) -> tuple[pa.Array, pa.Array]:
    """``(json, error)`` text arrays aligned with ``values``: for rows whose event type has a
    registered message type one of the two is set, both are null for every other row (only
    the registered rows are touched in Python)."""
    import numpy as np
    import pyarrow.compute as pc

    n = len(values)
    registered = pc.fill_null(pc.is_in(event_types, value_set=pa.array(list(kinds))), False)
    rows = np.flatnonzero(registered.to_numpy(zero_copy_only=False))
    texts: list[str | None] = [None] * n
    errors: list[str | None] = [None] * n
    picked = pa.array(rows, pa.int64())
    for i, value, event_type in zip(
        rows.tolist(),
        values.take(picked).to_pylist(),
        event_types.take(picked).to_pylist(),
        strict=True,
    ):
        texts[i], errors[i] = to_json(kinds[event_type], value)
    return pa.array(texts, pa.string()), pa.array(errors, pa.string())
