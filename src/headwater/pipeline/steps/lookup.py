"""Lookups for step 3: IP address -> location from a MaxMind-format database, user agent ->
browser, OS and device (the maintained ``ua-parser`` library).

Both are DuckDB functions over Arrow (``hw_geo``, ``hw_user_agent``, registered on the task's
connection by ``register``) that look up each *distinct* value of a vector once (events of one
visitor share an IP, and a few user agents cover most traffic) and spread the results back with
one vectorised ``take``. Each Python worker opens a database once, memory-mapped (the C reader of
``maxminddb`` when it is built, else its pure-Python one), and keeps an LRU cache of parsed user
agents. Unknown, private or malformed input gives null, never an error.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

Row = tuple[Any, ...]
Spec = tuple[tuple[str, pa.DataType], ...]  # a result's fields: name, Arrow type

GEO: Spec = (
    ("country", pa.string()),
    ("country_name", pa.string()),
    ("region", pa.string()),
    ("city", pa.string()),
    ("latitude", pa.float64()),
    ("longitude", pa.float64()),
    ("timezone", pa.string()),
)
USER_AGENT: Spec = (
    ("browser_family", pa.string()),
    ("browser_version", pa.string()),
    ("os_family", pa.string()),
    ("os_version", pa.string()),
    ("device_family", pa.string()),
    ("device_brand", pa.string()),
    ("device_model", pa.string()),
    ("bot", pa.bool_()),
)
GEO_FUNCTION = "hw_geo"
USER_AGENT_FUNCTION = "hw_user_agent"
_SQL_TYPES = {pa.string(): "VARCHAR", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN"}
_BOT_DEVICES = frozenset({"Spider"})


def sql_type(spec: Spec) -> str:
    """The DuckDB type of a result: ``STRUCT(name TYPE, ...)``."""
    return "STRUCT(" + ", ".join(f'"{n}" {_SQL_TYPES[t]}' for n, t in spec) + ")"


def map_distinct(
    values: pa.Array | pa.ChunkedArray, lookup: Callable[[Any], Row | None], fields: Spec
) -> pa.StructArray:
    """``lookup`` over the distinct values of ``values``, as a struct array of ``fields`` aligned
    with ``values`` (null where the value is null or ``lookup`` gives None)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    encoded = pc.dictionary_encode(values)
    rows = [lookup(v) for v in encoded.dictionary.to_pylist()]
    arrays = [
        pa.array([r[i] if r is not None else None for r in rows], type=arrow_type)
        for i, (_, arrow_type) in enumerate(fields)
    ]
    names = [name for name, _ in fields]
    mask = pa.array([r is None for r in rows], type=pa.bool_())
    distinct = pa.StructArray.from_arrays(arrays, names=names, mask=mask)
    return distinct.take(encoded.indices)


@functools.lru_cache(maxsize=8)
def _reader(path: str) -> Any:
    """The worker's reader of the database at ``path`` (opened once, memory-mapped)."""
    import maxminddb

    try:
        return maxminddb.open_database(path, maxminddb.MODE_MMAP_EXT)
    except ValueError:  # the C extension is not built: the pure-Python reader, still mmap'd
        return maxminddb.open_database(path, maxminddb.MODE_MMAP)


def _name(node: Any) -> str | None:
    return node.get("names", {}).get("en") if isinstance(node, dict) else None


# IPv4 /24 blocks that are partly global and partly not; every other /24 is wholly one or the
# other, so the answer for any address of it holds for all of them.
_MIXED_V4_BLOCKS = frozenset({"192.0.0", "255.255.255"})


def _is_global(ip: str) -> bool:
    """Whether ``ip`` (a valid address) is publicly routable; memoised per IPv4 /24."""
    if ":" not in ip:
        block = ip.rpartition(".")[0]
        if block not in _MIXED_V4_BLOCKS:
            return _is_global_v4_block(block)
    return _is_global_address(ip)


@functools.lru_cache(maxsize=65_536)
def _is_global_v4_block(block: str) -> bool:
    return _is_global_address(f"{block}.1")


def _is_global_address(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_global
    except ValueError:
        return False


def geo_of(reader: Any, ip: Any) -> Row | None:
    """The location of ``ip`` (a string) as a ``GEO_SCHEMA`` row, or None."""
    if not isinstance(ip, str):
        return None
    ip = ip.strip()
    try:
        found = reader.get(ip)
    except ValueError:  # not an address, or IPv6 in an IPv4-only database
        return None
    if not isinstance(found, dict) or not _is_global(ip):
        return None
    country = found.get("country") or {}
    subdivisions = found.get("subdivisions") or [None]
    location = found.get("location") or {}
    return (
        country.get("iso_code"),
        _name(country),
        _name(subdivisions[0]),
        _name(found.get("city")),
        location.get("latitude"),
        location.get("longitude"),
        location.get("time_zone"),
    )


def _version(v: Any) -> str | None:
    parts = [p for p in (v.major, v.minor, v.patch) if p] if v else []
    return ".".join(parts) or None


@functools.lru_cache(maxsize=20_000)
def parse_agent(agent: str) -> Row | None:
    """A ``UA_SCHEMA`` row for ``agent`` (None for an empty string), by ``ua_parser.parse``:
    the best resolver installed (re2 or the Rust ``regex`` backend if present, else the
    pure-Python one over the built-in uap-core rules)."""
    if not agent:
        return None
    from ua_parser import parse

    r = parse(agent)
    ua, os, dev = r.user_agent, r.os, r.device
    return (
        ua.family if ua else "Other",
        _version(ua),
        os.family if os else "Other",
        _version(os),
        dev.family if dev else "Other",
        dev.brand if dev else None,
        dev.model if dev else None,
        bool(dev and dev.family in _BOT_DEVICES),
    )


def _agent_of(value: Any) -> Row | None:
    return parse_agent(value) if isinstance(value, str) else None


def arrow_function(
    con: Any,
    name: str,
    fn: Callable[..., Any],
    arguments: list[str],
    returns: str,
    *,
    side_effects: bool = False,
) -> None:
    """Register ``fn`` on the DuckDB connection ``con`` as ``name``, called with Arrow arrays
    (a vector of rows at a time), nulls included."""
    con.create_function(
        name,
        fn,
        arguments,
        returns,
        type="arrow",
        side_effects=side_effects,
        null_handling="special",
    )


def register(con: Any, geoip_database: str | None) -> None:
    """Make ``hw_user_agent(text)`` and, with a database, ``hw_geo(text)`` callable on the
    DuckDB connection ``con``."""
    arrow_function(
        con,
        USER_AGENT_FUNCTION,
        lambda agents: map_distinct(agents, _agent_of, USER_AGENT),
        ["VARCHAR"],
        sql_type(USER_AGENT),
    )
    if geoip_database is not None:
        path = geoip_database
        arrow_function(
            con,
            GEO_FUNCTION,
            lambda ips: map_distinct(ips, lambda ip: geo_of(_reader(path), ip), GEO),
            ["VARCHAR"],
            sql_type(GEO),
        )
