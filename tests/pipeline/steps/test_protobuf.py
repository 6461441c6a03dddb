"""Protobuf payloads: registered event types decode to canonical JSON with the message type from
a descriptor set (built here from a hand-written FileDescriptorProto, as ``protoc -o`` would
write it); bytes that are not such a message give a reason naming the type."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

from headwater.bus import context
from headwater.pipeline.config import ProtobufType
from headwater.pipeline.steps.decode import INVALID_PROTOBUF
from headwater.pipeline.steps.protobuf import (
    ProtobufConfigError,
    decode_values,
    load_types,
    to_json,
)
from headwater.testing.pipeline import events_after_steps, source_table

FDP = descriptor_pb2.FieldDescriptorProto
MESSAGE = "shop.v1.Order"
PROTOBUF = "application/x-protobuf"


def order_file() -> descriptor_pb2.FileDescriptorProto:
    """shop/v1/order.proto: an Order with an enum, a nested message, repeated messages and
    scalars, an int64 and a google.protobuf.Timestamp."""
    f = descriptor_pb2.FileDescriptorProto(
        name="shop/v1/order.proto",
        package="shop.v1",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    status = f.enum_type.add(name="Status")
    for number, name in enumerate(["STATUS_UNSPECIFIED", "PAID", "SHIPPED"]):
        status.value.add(name=name, number=number)
    item = f.message_type.add(name="Item")
    item.field.add(name="sku", number=1, type=FDP.TYPE_STRING, label=FDP.LABEL_OPTIONAL)
    item.field.add(name="quantity", number=2, type=FDP.TYPE_INT32, label=FDP.LABEL_OPTIONAL)
    item.field.add(name="unit_price", number=3, type=FDP.TYPE_DOUBLE, label=FDP.LABEL_OPTIONAL)
    order = f.message_type.add(name="Order")
    customer = order.nested_type.add(name="Customer")
    customer.field.add(name="email", number=1, type=FDP.TYPE_STRING, label=FDP.LABEL_OPTIONAL)
    customer.field.add(name="vip", number=2, type=FDP.TYPE_BOOL, label=FDP.LABEL_OPTIONAL)

    def field(name: str, number: int, kind: int, label: int = FDP.LABEL_OPTIONAL, **kw) -> None:
        order.field.add(name=name, number=number, type=kind, label=label, **kw)

    field("order_id", 1, FDP.TYPE_STRING)
    field("status", 2, FDP.TYPE_ENUM, type_name=".shop.v1.Status")
    field("items", 3, FDP.TYPE_MESSAGE, FDP.LABEL_REPEATED, type_name=".shop.v1.Item")
    field("customer", 4, FDP.TYPE_MESSAGE, type_name=".shop.v1.Order.Customer")
    field("tags", 5, FDP.TYPE_STRING, FDP.LABEL_REPEATED)
    field("total_cents", 6, FDP.TYPE_INT64)
    field("placed_at", 7, FDP.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp")
    field("history", 8, FDP.TYPE_ENUM, FDP.LABEL_REPEATED, type_name=".shop.v1.Status")
    return f


def write_set(path: Path, *, include_imports: bool) -> Path:
    files = descriptor_pb2.FileDescriptorSet()
    if include_imports:  # protoc --include_imports puts dependencies first
        timestamp_pb2.DESCRIPTOR.CopyToProto(files.file.add())
    files.file.append(order_file())
    path.write_bytes(files.SerializeToString())
    return path


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_set(tmp_path_factory.mktemp("proto") / "order.desc", include_imports=False)


@pytest.fixture(scope="module")
def types(descriptor_set: Path) -> dict[str, ProtobufType]:
    return {"order": ProtobufType(descriptor_set=descriptor_set, message=MESSAGE)}


def order_bytes() -> bytes:
    """An Order serialised by a message class built independently of the code under test."""
    pool = descriptor_pool.DescriptorPool()
    ts = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(ts)
    pool.Add(ts)
    pool.Add(order_file())
    order_class = message_factory.GetMessageClass(pool.FindMessageTypeByName(MESSAGE))
    order = order_class(order_id="o-1", status=2, tags=["gift", "express"], total_cents=1234)
    order.items.add(sku="A-1", quantity=2, unit_price=9.5)
    order.items.add(sku="B-2", quantity=1)
    order.customer.email = "ada@example.com"
    order.customer.vip = True
    order.placed_at.seconds = 1_714_564_800  # 2024-05-01T12:00:00Z
    order.history.extend([1, 2])
    return order.SerializeToString()


EXPECTED = {
    "order_id": "o-1",
    "status": "SHIPPED",
    "items": [
        {"sku": "A-1", "quantity": 2, "unit_price": 9.5},
        {"sku": "B-2", "quantity": 1},
    ],
    "customer": {"email": "ada@example.com", "vip": True},
    "tags": ["gift", "express"],
    "total_cents": "1234",  # proto3 JSON writes int64 as a string
    "placed_at": "2024-05-01T12:00:00Z",
    "history": ["PAID", "SHIPPED"],
}
GARBAGE = b"\xff\xff\xff\xff"  # a tag whose varint never ends


def test_registered_types_decode_and_others_are_left_alone(types) -> None:
    kinds = load_types(types)
    values = [order_bytes(), b"", order_bytes(), order_bytes(), GARBAGE, None]
    event_types = ["order", "order", "track", None, "order", "order"]
    texts, errors = decode_values(pa.array(values, pa.binary()), pa.array(event_types), kinds)
    got = list(zip(texts.to_pylist(), errors.to_pylist(), strict=True))
    assert json.loads(got[0][0]) == EXPECTED and got[0][1] is None
    assert got[1] == ("{}", None)  # an empty message is a valid one
    assert got[2] == (None, None) and got[3] == (None, None)  # not registered, no type
    assert got[4][0] is None
    assert got[4][1].startswith(f"the value is not a valid protobuf message {MESSAGE}: ")
    assert got[5][0] is None and MESSAGE in got[5][1]  # a tombstone


def test_decode_step_turns_protobuf_into_events_and_fails_bad_bytes(tmp_path, types) -> None:
    source = source_table(
        [order_bytes(), GARBAGE], content_type=PROTOBUF, headers={context.TYPE: "order"}
    )
    events, errors = events_after_steps(
        source,
        tmp_path,
        pipeline={"protobuf": {k: v.model_dump(mode="json") for k, v in types.items()}},
    )
    # the decoded event is typed: date-time text became a timestamp
    want = {**EXPECTED, "placed_at": "2024-05-01T12:00:00.000000Z"}
    assert {k: v for k, v in events[0].items() if k in want} == want
    assert events[1] is None
    code, reason = errors[1]
    assert code == INVALID_PROTOBUF and MESSAGE in reason


def test_a_set_with_its_imports_decodes_alike(tmp_path: Path) -> None:
    path = write_set(tmp_path / "full.desc", include_imports=True)
    kind = load_types({"order": ProtobufType(descriptor_set=path, message=MESSAGE)})["order"]
    text, error = to_json(kind, order_bytes())
    assert error is None and json.loads(text or "") == EXPECTED


def test_unusable_registrations_are_config_errors(tmp_path: Path, descriptor_set: Path) -> None:
    missing = tmp_path / "missing.desc"
    with pytest.raises(ProtobufConfigError) as info:
        load_types({"order": ProtobufType(descriptor_set=missing, message=MESSAGE)})
    assert info.value.code == "HW-PIPE-104" and str(missing) in info.value.message

    with pytest.raises(ProtobufConfigError) as info:
        load_types({"order": ProtobufType(descriptor_set=descriptor_set, message="shop.v1.Nope")})
    assert "shop.v1.Nope" in info.value.message and "pipeline.protobuf.order" in info.value.message

    not_a_set = tmp_path / "text.desc"
    not_a_set.write_text("syntax = 'proto3';")
    with pytest.raises(ProtobufConfigError) as info:
        load_types({"order": ProtobufType(descriptor_set=not_a_set, message=MESSAGE)})
    assert str(not_a_set) in info.value.message
