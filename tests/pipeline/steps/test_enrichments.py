"""The enrichments beyond the lookups (bot_detect, referrer, campaign, ip_anonymize,
pii_pseudonymize), on events run through a destination's steps in-process, as a task runs them."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from headwater.bus import context
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.steps.enrichments import PiiKeyMissing
from headwater.testing.geoip import build_test_mmdb, city_record
from headwater.testing.pipeline import events_after_steps, source_table

KEY = "a-test-key"
GOOGLEBOT = "Mozilla/5.0 (compatible; Googlebot/2.1; +http://www.google.com/bot.html)"
CHROME = (
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36"
)


def shaped(
    tmp_path: Path,
    events: list[Any],
    enrichment: list[dict[str, Any]],
    each: list[dict[str, str | None]] | None = None,
    pipeline: dict[str, Any] | None = None,
) -> list[dict[str, Any] | None]:
    got, errors = events_after_steps(
        source_table(events, each=each), tmp_path, pipeline, enrichment=enrichment
    )
    assert not errors
    return got


def digest(value: str) -> str:
    return hmac.new(KEY.encode(), value.encode(), hashlib.sha256).hexdigest()


def page(url: str | None = None, referrer: str | None = None) -> dict[str, Any]:
    p = {k: v for k, v in (("url", url), ("referrer", referrer)) if v is not None}
    return {"event": "view", "context": {"page": p}}


def test_pii_fields_become_their_hmac_even_inside_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HW_PII_KEY", KEY)
    events = [
        {"email": "ada@example.com", "user": {"phone": 5551234}, "items": [{"email": "x@y"}, {}]},
        {"email": "ada@example.com"},
        {"email": None, "other": "kept"},
    ]
    rule = {"name": "pii_pseudonymize", "fields": ["/email", "/user", "/items/*/email"]}
    a, b, c = shaped(tmp_path, events, [rule])
    assert a is not None and b is not None and c is not None
    assert a["email"] == b["email"] == digest("ada@example.com")  # the same value, the same digest
    assert a["user"]["phone"] == digest("5551234")
    assert a["items"] == [{"email": digest("x@y")}, {}]
    assert "email" not in c and c["other"] == "kept"


def test_pii_without_its_key_is_an_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    rule = {"name": "pii_pseudonymize", "fields": ["/email"], "key_env": "NO_SUCH_KEY"}
    with pytest.raises(PiiKeyMissing, match="NO_SUCH_KEY"):
        shaped(tmp_path, [{"email": "x"}], [rule])


def test_ip_anonymize_zeroes_the_last_octets_and_segments_after_the_location_lookup(
    tmp_path: Path,
) -> None:
    geo = build_test_mmdb(
        tmp_path / "city.mmdb", {"81.2.69.0/24": city_record("GB", "United Kingdom", "London")}
    )
    each: list[dict[str, str | None]] = [
        {context.CLIENT_IP: "81.2.69.142"},
        {context.CLIENT_IP: "2001:db8:1:2:3:4:5:6"},
        {context.CLIENT_IP: "not an address"},
    ]
    rules = [
        {"name": "ip_anonymize", "octets": 2, "segments": 3},  # listed first, runs after
        {"name": "ip_lookup", "src": "/source_ip", "dst": "/location"},
    ]
    v4, v6, bad = shaped(
        tmp_path, [{"n": 1}, {"n": 2}, {"n": 3}], rules, each, {"geoip_database": str(geo)}
    )
    assert v4 is not None and v6 is not None and bad is not None
    assert v4["source_ip"] == "81.2.0.0"
    assert v4["location"]["city"] == "London"  # looked up on the whole address
    assert v6["source_ip"] == "2001:db8:1:2:3::"
    assert "source_ip" not in bad  # not an address: nothing of it kept


def test_bot_detect_marks_crawlers_and_can_drop_them(tmp_path: Path) -> None:
    each: list[dict[str, str | None]] = [
        {context.USER_AGENT: GOOGLEBOT},
        {context.USER_AGENT: CHROME},
        {context.USER_AGENT: None},
    ]
    bot, person, unknown = shaped(tmp_path / "a", [{}, {}, {}], [{"name": "bot_detect"}], each)
    assert bot is not None and person is not None and unknown is not None
    assert bot["bot"]["is_bot"] is True and "Googlebot" in bot["bot"]["pattern"]
    assert person["bot"] == {"is_bot": False}
    assert "bot" not in unknown
    dropped = shaped(
        tmp_path / "b", [{}, {}, {}], [{"name": "bot_detect", "drop_bots": True}], each
    )
    assert dropped[0] is None and dropped[1] is not None and dropped[2] is not None


def test_campaign_reads_utm_parameters_and_click_ids_url_decoded(tmp_path: Path) -> None:
    events = [
        page("https://shop.example/p?utm_source=news%20letter&utm_medium=email&fbclid=F1#top"),
        page("https://shop.example/p?utm_campaign=spring+sale&gclid=G1&msclkid=M1"),
        page("https://shop.example/plain"),
        {"url": "https://jitsu.example/?utm_source=jitsu"},  # Jitsu's field
    ]
    rule = {
        "name": "campaign",
        "mapping": {
            "utm_source": "/mkt_source",
            "utm_medium": "/mkt_medium",
            "utm_campaign": "/mkt/campaign",
        },
    }
    a, b, c, d = shaped(tmp_path, events, [rule])
    assert a is not None and b is not None and c is not None and d is not None
    assert (a["mkt_source"], a["mkt_medium"]) == ("news letter", "email")
    assert (a["mkt_clickid"], a["mkt_network"]) == ("F1", "Facebook")
    assert b["mkt"]["campaign"] == "spring sale"
    assert (b["mkt_clickid"], b["mkt_network"]) == ("G1", "Google")  # the first in the list
    assert not any(k.startswith("mkt") for k in c)
    assert d["mkt_source"] == "jitsu"


def test_referrer_tells_search_social_email_internal_and_unknown(tmp_path: Path) -> None:
    shop = "https://shop.example/cart"
    events = [
        page(shop, "https://www.google.com/search?q=boots"),
        page(shop, "https://t.co/abc"),
        page(shop, "https://mail.google.com/mail/u/0/"),
        page(shop, "https://shop.example/"),
        page(shop, "https://blog.partner.example/post"),
        page(shop, "https://intranet.corp/"),
        page(shop, "::not a url::"),
        page(shop, "https://forum.example/t/1"),
    ]
    rule = {
        "name": "referrer",
        "internal_hosts": ["intranet.corp"],
        "extra": {"social": {"forum.example": "Forum"}},
    }
    got = shaped(tmp_path, events, [rule])
    parsed = [(e or {}).get("referrer_parsed") for e in got]
    assert parsed[0] == {
        "host": "www.google.com",
        "path": "/search",
        "medium": "search",
        "source": "Google",
    }
    assert parsed[1] == {"host": "t.co", "path": "/abc", "medium": "social", "source": "Twitter"}
    assert parsed[2]["medium"] == "email" and parsed[2]["source"] == "Gmail"
    assert parsed[3]["medium"] == "internal" and parsed[5]["medium"] == "internal"
    assert parsed[4] == {"host": "blog.partner.example", "path": "/post", "medium": "unknown"}
    assert parsed[6] is None
    assert parsed[7]["source"] == "Forum"


def test_bad_enrichment_config_is_named() -> None:
    bad = [
        ({"name": "ip_anonymize", "octets": 5}, "octets"),
        ({"name": "pii_pseudonymize", "fields": []}, "fields"),
        ({"name": "nope"}, "nope"),
    ]
    for rule, key in bad:
        dest = {"id": "w", "type": "duckdb", "enrichment": [rule]}
        with pytest.raises(ValidationError, match=key):
            HeadwaterConfig.model_validate({"pipeline": {"destinations": [dest]}})


def test_the_settings_never_carry_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from headwater.testing.pipeline import process

    monkeypatch.setenv("HW_PII_KEY", KEY)
    dest = {
        "type": "files",
        "path": str(tmp_path / "f"),
        "enrichment": [{"name": "pii_pseudonymize", "fields": ["/email"]}],
    }
    done = process(source_table([{"email": "x"}]), dest, path=tmp_path)
    assert KEY not in json.dumps(done.plan.program.settings)
    assert KEY not in done.plan.program.to_json()


def test_fingerprint_drops_repeats_within_the_window_across_runs_but_never_a_replayed_event(
    tmp_path: Path,
) -> None:
    from headwater.pipeline.steps import seen_store
    from headwater.testing.pipeline import process

    store = tmp_path / "seen"
    rule = {"name": "fingerprint", "fields": ["/order"], "window_s": 3600, "store": str(store)}
    dest = {
        "type": "files",
        "format": "jsonl.gz",
        "path": str(tmp_path / "f"),
        "enrichment": [rule],
    }

    def run(events: list[Any], each: list[dict[str, str | None]]) -> list[str]:
        done = process(source_table(events, each=each), dest, path=tmp_path)
        return [json.loads(r["event"])["eventn_ctx"]["event_id"] for r in done.rows()]

    def at(event_id: str, when: str) -> dict[str, str | None]:
        return {context.EVENT_ID: event_id, context.RECEIVED_AT: when}

    first = [{"order": 1}, {"order": 2}, {"order": 1}]
    stamps = [
        at("a", "2024-05-01T12:00:00Z"),
        at("b", "2024-05-01T12:00:01Z"),
        at("c", "2024-05-01T12:00:02Z"),
    ]
    assert run(first, stamps) == ["a", "b"]  # c repeats a's order
    assert run(first, stamps) == ["a", "b"]  # the same batch again: the same answer
    seen_store.forget()  # a restarted worker: the file holds what was seen
    later = [{"order": 2}, {"order": 1}, {"order": 3}]
    stamps = [
        at("d", "2024-05-01T12:30:00Z"),
        at("e", "2024-05-01T14:00:00Z"),
        at("f", "2024-05-01T12:30:00Z"),
    ]
    assert run(later, stamps) == ["e", "f"]  # d repeats b within the hour; e comes after it


def test_campaign_takes_the_first_click_id_of_the_url_and_ignores_what_is_no_query(
    tmp_path: Path,
) -> None:
    events = [
        page("https://shop.example/p?msclkid=M1&gclid=G1"),
        page("https://shop.example/p#utm_source=x"),  # a fragment, not the query
        page("https://shop.example/p?xutm_source=x&utm_source="),  # another name; empty
        page("::not a url?utm_source=odd%2Fvalue"),
        {"context": {"page": {"url": 42}}},  # not a string
    ]
    a, b, c, d, e = shaped(tmp_path, events, [{"name": "campaign"}])
    assert a is not None and b is not None and c is not None and d is not None and e is not None
    assert (a["mkt_clickid"], a["mkt_network"]) == ("M1", "Microsoft")
    for plain in (b, c, e):
        assert not any(k.startswith("mkt") for k in plain), plain
    assert d["mkt_source"] == "odd/value"


def test_ip_anonymize_reads_every_written_form_of_an_address(tmp_path: Path) -> None:
    each: list[dict[str, str | None]] = [
        {context.CLIENT_IP: "2001:db8::1"},
        {context.CLIENT_IP: "::ffff:81.2.69.142"},
        {context.CLIENT_IP: "10.1.2.3"},
    ]
    rules = [{"name": "ip_anonymize"}]  # defaults: one octet, four segments
    short, mapped, private = shaped(tmp_path, [{}, {}, {}], rules, each)
    assert short is not None and mapped is not None and private is not None
    assert short["source_ip"] == "2001:db8::"
    assert mapped["source_ip"] == "::"  # an IPv6 address: its last four segments
    assert private["source_ip"] == "10.1.2.0"
