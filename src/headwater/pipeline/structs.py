"""Paths into the event struct: read, set and drop a field by path, knowing the struct's type.

The steps work on ``event`` as a Spark struct whose type is known when the batch's plan is
built (the carried shape, ``headwater.pipeline.shape``), so every path operation is decided in
Python and becomes one native expression: no per-row Python, no JSON rebuilt.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructField, StructType

Path = tuple[str, ...]


def field_ref(path: Path) -> str:
    """A dotted reference with every part quoted (names may hold dots or spaces)."""
    return ".".join("`" + p.replace("`", "``") + "`" for p in path)


def field_at(node: Column, path: Path) -> Column:
    """The value at ``path`` inside the struct column ``node`` (the path is known to exist)."""
    for part in path:
        node = node.getField(part)
    return node


def type_at(struct: DataType, path: Path) -> DataType | None:
    """The type at ``path`` inside ``struct`` (None when the path does not exist)."""
    node: DataType = struct
    for part in path:
        if not isinstance(node, StructType) or part not in node.names:
            return None
        node = node[part].dataType
    return node


def get_path(event: Column, struct: DataType, path: Path) -> Column | None:
    """The value at ``path`` (None when the type has no such path: it is always missing)."""
    if type_at(struct, path) is None:
        return None
    out = event
    for part in path:
        out = out.getField(part)
    return out


def set_path(event: Column, struct: StructType, path: Path, value: Column) -> Column:
    """``event`` with ``value`` at ``path``; missing objects on the way are created, a non-object
    on the way is replaced by one. A null ``event`` stays null."""
    return F.when(event.isNotNull(), _set(event, struct, path, value))


def _set(node: Column | None, struct: DataType | None, path: Path, value: Column) -> Column:
    head, rest = path[0], path[1:]
    if not isinstance(struct, StructType) or node is None:
        # nothing (or a value) here: build the object
        inner = value if not rest else _set(None, None, rest, value)
        return F.struct(inner.alias(head))
    if not rest:
        return node.withField(head, value)
    child_type = struct[head].dataType if head in struct.names else None
    child = node.getField(head) if child_type is not None else None
    if isinstance(child_type, StructType):
        assert child is not None
        # a null object gets one of the same type (all fields null) so both branches agree
        filled = F.coalesce(child, nulls(child_type))
        built = _set(filled, child_type, rest, value)
    else:
        built = _set(None, None, rest, value)
    return node.withField(head, built)


def nulls(struct: StructType) -> Column:
    """A struct of type ``struct`` with every field null."""
    return F.struct(*[F.lit(None).cast(f.dataType).alias(f.name) for f in struct.fields])


def drop_path(event: Column, struct: StructType, path: Path) -> Column:
    """``event`` without the field at ``path`` (unchanged when there is none)."""
    if type_at(struct, path) is None:
        return event
    if len(path) == 1:
        if len(struct.names) == 1:  # Spark cannot drop a struct's only field
            return F.when(F.lit(False), event)
        return event.dropFields(path[0])
    parent_type = type_at(struct, path[:-1])
    assert isinstance(parent_type, StructType)
    if len(parent_type.names) == 1:  # the parent would be empty: drop it instead
        return drop_path(event, struct, path[:-1])
    return event.dropFields(field_ref(path))


def leaves(struct: StructType, prefix: Path = ()) -> list[tuple[Path, DataType]]:
    """Every non-struct field, depth first, in field order."""
    out: list[tuple[Path, DataType]] = []
    for f in struct.fields:
        path = (*prefix, f.name)
        if isinstance(f.dataType, StructType):
            out.extend(leaves(f.dataType, path))
        else:
            out.append((path, f.dataType))
    return out


def nested(fields: dict[Path, DataType]) -> StructType:
    """The struct type holding ``fields`` (path -> leaf type) at their paths, in given order."""
    tree: dict[str, object] = {}
    for path, t in fields.items():
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            assert isinstance(child, dict), f"{path} is below a leaf"
            node = child
        node[path[-1]] = t
    return _build(tree)


def _build(tree: dict[str, object]) -> StructType:
    out = []
    for name, node in tree.items():
        t = _build(node) if isinstance(node, dict) else node
        assert isinstance(t, DataType)
        out.append(StructField(name, t))
    return StructType(out)
