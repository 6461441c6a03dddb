"""Lookups for step 3: IP address -> location from a MaxMind-format database, user agent ->
browser, OS and device (the maintained ``ua-parser`` library, pure-Python resolver here).

Both are vectorised (pandas) UDFs; each Python worker opens the database once (memory-mapped)
and keeps an LRU cache of parsed user agents, which repeat a lot. Unknown, private or malformed
input gives null, never an error.
"""

from __future__ import annotations

import functools
import ipaddress
from pathlib import Path
from typing import Any

import pandas as pd
from pyspark.sql import Column
from pyspark.sql import functions as F

GEO_FIELDS = ("country", "country_name", "region", "city", "latitude", "longitude", "timezone")
GEO_SCHEMA = (
    "struct<country:string,country_name:string,region:string,city:string,"
    "latitude:double,longitude:double,timezone:string>"
)
UA_FIELDS = (
    "browser_family",
    "browser_version",
    "os_family",
    "os_version",
    "device_family",
    "device_brand",
    "device_model",
    "bot",
)
UA_SCHEMA = (
    "struct<browser_family:string,browser_version:string,os_family:string,os_version:string,"
    "device_family:string,device_brand:string,device_model:string,bot:boolean>"
)
_BOT_DEVICES = {"Spider"}


@functools.lru_cache(maxsize=8)
def _reader(path: str) -> Any:
    import maxminddb

    return maxminddb.open_database(path, maxminddb.MODE_MMAP)


def _name(node: Any) -> str | None:
    return (node or {}).get("names", {}).get("en") if isinstance(node, dict) else None


def geo_of(reader: Any, ip: Any) -> tuple[Any, ...] | None:
    """The location of ``ip`` (a string), or None."""
    if not isinstance(ip, str):
        return None
    try:
        addr = ipaddress.ip_address(ip.strip())
    except ValueError:
        return None
    if not addr.is_global:
        return None
    try:
        found = reader.get(str(addr))
    except ValueError:  # an IPv6 address in an IPv4-only database
        return None
    if not isinstance(found, dict):
        return None
    country = found.get("country") or {}
    subdivisions = found.get("subdivisions") or [{}]
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


def geo_lookup(col: Column, database: Path) -> Column:
    """``col`` (an IP address string) -> ``GEO_SCHEMA`` struct, null when not found."""
    path = str(database)

    @F.pandas_udf(GEO_SCHEMA)  # type: ignore[call-overload]
    def lookup(ips: pd.Series) -> pd.DataFrame:
        reader = _reader(path)
        empty = (None,) * len(GEO_FIELDS)
        return pd.DataFrame([geo_of(reader, ip) or empty for ip in ips], columns=list(GEO_FIELDS))

    result = lookup(col)
    return F.when(col.isNotNull() & result["country"].isNotNull(), result)


@functools.lru_cache(maxsize=20_000)
def parse_agent(agent: str) -> tuple[Any, ...]:
    from ua_parser import parse

    r = parse(agent)
    ua, os, dev = r.user_agent, r.os, r.device

    def version(v: Any) -> str | None:
        parts = [p for p in (v.major, v.minor, v.patch) if p] if v else []
        return ".".join(parts) or None

    return (
        ua.family if ua else "Other",
        version(ua),
        os.family if os else "Other",
        version(os),
        dev.family if dev else "Other",
        dev.brand if dev else None,
        dev.model if dev else None,
        bool(dev and dev.family in _BOT_DEVICES),
    )


def parse_user_agent(col: Column) -> Column:
    """``col`` (a User-Agent string) -> ``UA_SCHEMA`` struct, null for a missing agent."""

    @F.pandas_udf(UA_SCHEMA)  # type: ignore[call-overload]
    def parse(agents: pd.Series) -> pd.DataFrame:
        empty = (None,) * len(UA_FIELDS)
        rows = [parse_agent(a) if isinstance(a, str) and a else empty for a in agents]
        return pd.DataFrame(rows, columns=list(UA_FIELDS))

    return F.when(col.isNotNull() & (F.length(col) > 0), parse(col))
