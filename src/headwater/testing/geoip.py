"""A small MaxMind-format (.mmdb) database for tests, in the GeoIP2-City record layout, built
with the ``mmdb-writer`` package (the testing extra) so tests need no licensed GeoLite file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from headwater.errors import MissingDependencyError


def city_record(
    country: str,
    country_name: str,
    city: str,
    region: str | None = None,
    latitude: float = 0.0,
    longitude: float = 0.0,
    time_zone: str = "UTC",
    region_code: str | None = None,
) -> dict[str, Any]:
    """A GeoIP2-City record: ``country``, ``subdivisions`` (when ``region`` is given), ``city``
    and ``location``, names in English."""
    record: dict[str, Any] = {
        "country": {"iso_code": country, "names": {"en": country_name}},
        "city": {"names": {"en": city}},
        "location": {"latitude": latitude, "longitude": longitude, "time_zone": time_zone},
    }
    if region is not None:
        subdivision: dict[str, Any] = {"names": {"en": region}}
        if region_code is not None:
            subdivision["iso_code"] = region_code
        record["subdivisions"] = [subdivision]
    return record


def build_test_mmdb(path: Path, networks: Mapping[str, dict[str, Any]]) -> Path:
    """Write ``networks`` (CIDR such as ``"81.2.69.0/24"`` or ``"2001:218::/32"`` -> record) as
    a MaxMind DB at ``path`` (an IPv6 tree with IPv4 mapped into it, as GeoIP2-City ships)."""
    try:
        from mmdb_writer import MMDBWriter
        from netaddr import IPSet
    except ImportError as exc:
        raise MissingDependencyError("mmdb_writer", "testing") from exc

    writer = MMDBWriter(
        ip_version=6,
        ipv4_compatible=True,
        database_type="GeoIP2-City",
        languages=["en"],
        description="headwater test",
    )
    for cidr, record in networks.items():
        writer.insert_network(IPSet([cidr]), record)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.to_db_file(str(path))
    return path
