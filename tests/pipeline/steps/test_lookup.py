"""Step 3's lookups: IP -> location from a MaxMind-format database the test builds, and user
agent parsing, as the DuckDB functions the tasks call; then the rules, configured and implicit,
on events."""

from __future__ import annotations

from pathlib import Path

import duckdb
import maxminddb
import pyarrow as pa
import pytest

from headwater.bus import context
from headwater.pipeline.steps.lookup import GEO, map_distinct, register
from headwater.testing.geoip import build_test_mmdb, city_record
from headwater.testing.pipeline import events_after_steps, source_table

CHROME = (
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36"
)
IPHONE = (
    "Mozilla/5.0 (iPhone; CPU iPhone OS 17_4 like Mac OS X) AppleWebKit/605.1.15 "
    "(KHTML, like Gecko) Version/17.4 Mobile/15E148 Safari/604.1"
)
GOOGLEBOT = "Mozilla/5.0 (compatible; Googlebot/2.1; +http://www.google.com/bot.html)"


@pytest.fixture(scope="module")
def geo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_mmdb(
        tmp_path_factory.mktemp("geo") / "city.mmdb",
        {
            "81.2.69.0/24": city_record(
                "GB",
                "United Kingdom",
                "London",
                "England",
                51.5142,
                -0.0931,
                "Europe/London",
                "ENG",
            ),
            "2001:218::/32": city_record("JP", "Japan", "Tokyo", None, 35.68, 139.75, "Asia/Tokyo"),
            # private ranges a careless database holds: the lookup must still give null
            "10.0.0.0/8": city_record("ZZ", "Nowhere", "Intranet"),
            "fc00::/7": city_record("ZZ", "Nowhere", "Intranet"),
        },
    )


def test_the_built_database_is_valid_maxmind(geo_db: Path) -> None:
    with maxminddb.open_database(str(geo_db)) as reader:
        assert reader.metadata().database_type == "GeoIP2-City"
        london = reader.get("81.2.69.160")
        assert london["city"]["names"]["en"] == "London"  # type: ignore[index,call-overload]
        assert london["subdivisions"][0]["iso_code"] == "ENG"  # type: ignore[index,call-overload]
        assert reader.get("2001:218::1")["country"]["iso_code"] == "JP"  # type: ignore[index]
        assert reader.get("8.8.8.8") is None


def lookups(function: str, values: list[str | None], geo_db: Path | None = None) -> list:
    con = duckdb.connect()
    register(con, str(geo_db) if geo_db else None)
    con.register("t", pa.table({"i": list(range(len(values))), "v": pa.array(values, pa.string())}))
    return [r[0] for r in con.execute(f"select {function}(v) from t order by i").fetchall()]


def test_geo_lookup(geo_db: Path) -> None:
    ips = ["81.2.69.160", "2001:218::1", "8.8.8.8", "10.0.0.1", "not an ip", None, " 81.2.69.1"]
    ips += ["2a00:1450::1", "fd00::1", "::1", "fe80::1", "", "81.2.69.999", "81.2.69.160"]
    got = lookups("hw_geo", ips, geo_db)
    london = got[0]
    assert london == {
        "country": "GB",
        "country_name": "United Kingdom",
        "region": "England",
        "city": "London",
        "latitude": 51.5142,
        "longitude": -0.0931,
        "timezone": "Europe/London",
    }
    assert got[1]["city"] == "Tokyo" and got[1]["region"] is None
    assert got[2:6] == [None, None, None, None]  # unknown, private, garbage, null
    assert got[6]["city"] == "London"  # surrounding spaces are tolerated
    # unknown IPv6, private IPv6 (in the database or not), empty, out-of-range octet
    assert got[7:13] == [None] * 6
    assert got[13] == got[0]  # a repeat within the batch gets the same answer


def test_map_distinct_aligns_results_with_repeats_and_nulls() -> None:
    seen: list[str] = []

    def lookup(v):
        seen.append(v)
        return None if v == "none" else (v.upper(),)

    values = pa.array(["a", None, "b", "a", "none", "b", "a"])
    got = map_distinct(values, lookup, GEO[:1]).to_pylist()
    assert got == [
        {"country": "A"},
        None,
        {"country": "B"},
        {"country": "A"},
        None,
        {"country": "B"},
        {"country": "A"},
    ]
    assert sorted(seen) == ["a", "b", "none"]  # each distinct value looked up once


def test_user_agent_parsing() -> None:
    got = lookups("hw_user_agent", [CHROME, IPHONE, GOOGLEBOT, "", None, CHROME])
    assert (got[0]["browser_family"], got[0]["browser_version"], got[0]["os_family"]) == (
        "Chrome",
        "124.0.0",
        "Windows",
    )
    assert (got[1]["browser_family"], got[1]["os_family"], got[1]["device_brand"]) == (
        "Mobile Safari",
        "iOS",
        "Apple",
    )
    assert got[1]["os_version"] == "17.4" and got[1]["bot"] is False
    assert got[2]["browser_family"] == "Googlebot" and got[2]["bot"] is True
    assert got[0]["bot"] is False and got[0]["device_family"] == "Other"
    assert got[3:5] == [None, None]
    assert got[5] == got[0]


def test_rules_configured_and_implicit_for_browser_events(geo_db: Path, tmp_path: Path) -> None:
    # a browser event through the Segment API: the implicit rules apply; a server-side event:
    # only the configured rule
    browser = source_table(
        [{"ip": "81.2.69.160"}],
        headers={context.PROTOCOL: "segment", context.USER_AGENT: CHROME},
    )
    server = source_table(
        [{"ip": "2001:218::1"}],
        headers={
            context.PROTOCOL: "raccoon-ws",
            context.USER_AGENT: "curl/8",
            context.EVENT_ID: "ev-1",
        },
    )
    server = server.set_column(4, "offset", pa.array([1], pa.int64()))
    events, _ = events_after_steps(
        pa.concat_tables([browser, server]).replace_schema_metadata(),
        tmp_path,
        enrichment=[{"name": "ip_lookup", "src": "/ip", "dst": "/geo"}],
        pipeline={"geoip_database": str(geo_db)},
    )
    browser_event, server_event = events
    assert browser_event["geo"]["city"] == "London"
    assert browser_event["eventn_ctx"]["location"]["country"] == "GB"  # from 81.2.69.142
    assert browser_event["eventn_ctx"]["parsed_ua"]["browser_family"] == "Chrome"
    assert server_event["geo"]["city"] == "Tokyo"
    assert "location" not in server_event["eventn_ctx"]
    assert "parsed_ua" not in server_event["eventn_ctx"]


def test_an_ip_lookup_rule_needs_a_database(tmp_path: Path) -> None:
    from headwater.errors import ConfigError

    with pytest.raises(ConfigError, match="geoip_database"):
        events_after_steps(
            source_table([{"ip": "81.2.69.160"}]),
            tmp_path,
            enrichment=[{"name": "ip_lookup", "src": "/ip", "dst": "/geo"}],
        )
