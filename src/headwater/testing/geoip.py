"""A small MaxMind-format (.mmdb) database for tests, in the GeoIP2-City record layout, built
with the ``mmdb-writer`` package (the testing extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def city_record(
    country: str,
    country_name: str,
    city: str,
    region: str | None = None,
    latitude: float = 0.0,
    longitude: float = 0.0,
    time_zone: str = "UTC",
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "country": {"iso_code": country, "names": {"en": country_name}},
        "city": {"names": {"en": city}},
        "location": {"latitude": latitude, "longitude": longitude, "time_zone": time_zone},
    }
    if region is not None:
        record["subdivisions"] = [{"names": {"en": region}}]
    return record


def build_test_mmdb(path: Path, networks: Mapping[str, dict[str, Any]]) -> Path:
    """Write ``networks`` (CIDR -> record) as a MaxMind DB at ``path``."""
    from mmdb_writer import MMDBWriter
    from netaddr import IPSet

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
