"""Step 3's lookups: IP -> location from a MaxMind-format database the test builds, and user
agent parsing; then the rules, configured and implicit, on events."""

from __future__ import annotations

import json
from pathlib import Path

import maxminddb
import pyarrow as pa
import pytest

from headwater.bus import context
from headwater.pipeline.columns import EVENT
from headwater.pipeline.config import EnrichmentRule
from headwater.pipeline.steps.context import enrich_context
from headwater.pipeline.steps.decode import decode
from headwater.pipeline.steps.lookup import (
    GEO_SCHEMA,
    UA_SCHEMA,
    geo_lookup,
    map_distinct,
    parse_user_agent,
)
from headwater.pipeline.steps.lookup_rules import apply_lookups
from headwater.testing.geoip import build_test_mmdb, city_record
from headwater.testing.pipeline import batch

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


def test_geo_lookup(spark, geo_db: Path) -> None:
    ips = ["81.2.69.160", "2001:218::1", "8.8.8.8", "10.0.0.1", "not an ip", None, " 81.2.69.1"]
    ips += ["2a00:1450::1", "fd00::1", "::1", "fe80::1", "", "81.2.69.999", "81.2.69.160"]
    df = spark.createDataFrame([(i, ip) for i, ip in enumerate(ips)], "i int, ip string")
    out = df.select("i", geo_lookup(df.ip, geo_db).alias("geo"))
    assert out.schema["geo"].dataType == GEO_SCHEMA
    got = [r.geo for r in out.orderBy("i").collect()]
    london = got[0].asDict()
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
    fields = GEO_SCHEMA.fields[:1]
    seen: list[str] = []

    def lookup(v):
        seen.append(v)
        return None if v == "none" else (v.upper(),)

    arrow_fields = [(f.name, f.dataType, pa.string()) for f in fields]
    values = pa.array(["a", None, "b", "a", "none", "b", "a"])
    got = map_distinct(values, lookup, arrow_fields).to_pylist()
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


def test_user_agent_parsing(spark) -> None:
    agents = [CHROME, IPHONE, GOOGLEBOT, "", None, CHROME]
    df = spark.createDataFrame(list(enumerate(agents)), "i int, ua string")
    out = df.select("i", parse_user_agent(df.ua).alias("p"))
    assert out.schema["p"].dataType == UA_SCHEMA
    got = [r.p for r in out.orderBy("i").collect()]
    assert (got[0].browser_family, got[0].browser_version, got[0].os_family) == (
        "Chrome",
        "124.0.0",
        "Windows",
    )
    assert (got[1].browser_family, got[1].os_family, got[1].device_brand) == (
        "Mobile Safari",
        "iOS",
        "Apple",
    )
    assert got[1].os_version == "17.4" and got[1].bot is False
    assert got[2].browser_family == "Googlebot" and got[2].bot is True
    assert got[0].bot is False and got[0].device_family == "Other"
    assert got[3:5] == [None, None]
    assert got[5] == got[0]


def test_rules_configured_and_implicit_for_browser_events(spark, geo_db: Path) -> None:
    rows = [
        # a browser event through the Segment API: the implicit rules apply
        ({"ip": "81.2.69.160"}, {context.PROTOCOL: "segment", context.USER_AGENT: CHROME}),
        # a server-side event: only the configured rule
        ({"ip": "2001:218::1"}, {context.PROTOCOL: "raccoon-ws", context.USER_AGENT: "curl/8"}),
    ]
    frames = [batch(spark, [v], headers=h) for v, h in rows]
    df = frames[0].unionByName(frames[1])
    rule = EnrichmentRule(name="ip_lookup", src="/ip", dst="/geo")
    out = apply_lookups(enrich_context(decode(df)), [rule], geo_db)
    events = [json.loads(r.e) for r in out.select(F_json()).orderBy("offset").collect()]
    browser, server = events
    assert browser["geo"]["city"] == "London"
    assert browser["eventn_ctx"]["location"]["country"] == "GB"  # from source_ip 81.2.69.142
    assert browser["eventn_ctx"]["parsed_ua"]["browser_family"] == "Chrome"
    assert server["geo"]["city"] == "Tokyo"
    assert "location" not in server["eventn_ctx"] and "parsed_ua" not in server["eventn_ctx"]


def F_json():
    from pyspark.sql import functions as F

    return F.to_json(F.col(EVENT)).alias("e")
