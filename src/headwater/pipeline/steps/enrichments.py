"""Step 3's enrichments beyond the lookups, each a change of the event's fields in the task's
query (pure SQL, or a DuckDB function over Arrow that works on each distinct value once), run in
this order after ``ip_lookup`` and ``user_agent_parse``:

- ``bot_detect``: ``{is_bot, pattern}`` at ``dst`` from the user agent, by the
  ``crawler-user-agents`` list (the maintained list of crawler patterns, ~1,500 of them, on
  PyPI; ua-parser's "Spider" device knows far fewer); ``drop_bots`` discards bots' events.
  ``crawlerdetect`` was measured beside it (``bench/enrichments.py``): over 978 distinct agents
  it took 320 ms to this list's 420 ms and both caught the same crawlers, but each distinct
  agent is checked once per worker, so the difference is under 0.1 s per run; this list is
  the one more projects use and update (and names the pattern that matched);
- ``referrer``: ``{host, path, medium, source}`` at ``dst`` from the referrer URL: ``medium`` is
  ``internal`` (the page's own host, or ``internal_hosts``), ``search``, ``social`` or ``email``
  (by the hosts in ``referrers.json`` beside this module, plus the config's ``extra``), else
  ``unknown``. PyPI's ``referer-parser``, which ships Snowplow's list, was last released in
  2016, so the table lives here;
- ``campaign``: the page URL's ``utm_*`` parameters (URL-decoded) into ``mkt_source``,
  ``mkt_medium``, ``mkt_campaign``, ``mkt_term``, ``mkt_content`` (a configurable mapping), and
  the first click id (``gclid``, ``fbclid``, ``msclkid``...) into ``mkt_clickid`` with its
  network in ``mkt_network``; pure SQL (over 1,000,000 URLs, 3.9 s for twelve parameters by
  ``regexp_extract`` against 8.6 s for a function parsing each distinct URL in Python: click
  ids make most URLs distinct);
- ``ip_anonymize``: the IP address with its last ``octets`` (IPv4) or ``segments`` (IPv6) set to
  0, after the location lookup has read the whole address;
- ``pii_pseudonymize``: each listed field (and every value below it; ``*`` for every item of an
  array) replaced by the hex HMAC-SHA256 of its text under a key read from the environment
  variable ``key_env`` in each worker (the key never travels in the program). The same value
  gives the same digest, so joins on it still work; to rotate the key, set the new one and
  restart: digests made before and after differ.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa

from headwater.errors import ConfigError
from headwater.pipeline import sql
from headwater.pipeline.columns import pointer_parts
from headwater.pipeline.enrichment_config import (
    BotDetect,
    Campaign,
    IpAnonymize,
    PiiPseudonymize,
    Referrer,
)
from headwater.pipeline.fields import (
    BOOLEAN,
    RAW,
    TEXT,
    Field,
    Fields,
    as_text,
    set_subtree,
    subtree,
)
from headwater.pipeline.shape import BOOL, STRING
from headwater.pipeline.steps.pseudonyms import Pseudonyms

STRINGS = frozenset({STRING})
BOT_FUNCTION = "hw_bot"
REFERRER_FUNCTION = "hw_referrer"
ANONYMIZE_FUNCTION = "hw_ip_anonymize"
HMAC_FUNCTION = "hw_hmac"
HMAC_JSON_FUNCTION = "hw_hmac_json"
KEY_ENV = "pii_key_env"  # settings: the key's variable
REFERRERS = "referrers"  # settings: the referrer hosts (built-in and extra), internal hosts
BOT = (("is_bot", pa.bool_()), ("pattern", pa.string()))
REFERRER = (("host", pa.string()), ("path", pa.string()), ("medium", pa.string()))
REFERRER += (("source", pa.string()),)


class PiiKeyMissing(ConfigError):
    """pii_pseudonymize's key variable is not set."""

    code = "HW-PIPE-521"


def first_of(fields: Fields, pointers: list[str]) -> str | None:
    """The text of the first of ``pointers`` an event has (SQL), None when no event has any."""
    found = [as_text(fields[p]) for p in map(pointer_parts, pointers) if p in fields]
    if not found:
        return None
    return found[0] if len(found) == 1 else f"COALESCE({', '.join(found)})"


def _struct(column: str, spec: tuple[tuple[str, pa.DataType], ...], at: tuple[str, ...]) -> Fields:
    forms = {pa.string(): (TEXT, STRINGS), pa.bool_(): (BOOLEAN, frozenset({BOOL}))}
    out: Fields = {}
    for name, kind in spec:
        form, kinds = forms[kind]
        out[(name,)] = Field((*at, name), f"{column}.{sql.ident(name)}", form, kinds)
    return out


def bot_detect(fields: Fields, rule: BotDetect, column: str) -> tuple[Fields, str | None, str]:
    """The fields with ``{is_bot, pattern}``; the SQL argument of the call (None: no event has a
    user agent); the condition of a bot (for drop_bots)."""
    agent = first_of(fields, [rule.src])
    if agent is None:
        return fields, None, sql.FALSE
    at = pointer_parts(rule.dst)
    out = set_subtree(fields, at, _struct(sql.ident(column), BOT, at), None)
    return out, agent, f"COALESCE({sql.ident(column)}.is_bot, false)"


def referrer(fields: Fields, rule: Referrer, column: str) -> tuple[Fields, str | None]:
    url = first_of(fields, rule.src)
    if url is None:
        return fields, None
    page = first_of(fields, rule.page) or sql.NULL
    host = f"lower(regexp_extract({page}, '^[a-zA-Z][a-zA-Z0-9+.-]*://([^/?#:@]*)', 1))"
    at = pointer_parts(rule.dst)
    out = set_subtree(fields, at, _struct(sql.ident(column), REFERRER, at), None)
    return out, f"CASE WHEN {url} IS NOT NULL THEN {url} || chr(31) || COALESCE({host}, '') END"


def campaign(fields: Fields, rule: Campaign) -> Fields:
    """The mapped parameters of the page URL's query, and its first click id with its network
    (``regexp_extract``, each only on URLs that contain the parameter's name: most have none)."""
    url = first_of(fields, rule.src)
    if url is None:
        return fields

    def decoded(raw: str) -> str:
        return f"url_decode(replace(NULLIF({raw}, ''), '+', ' '))"

    def param(name: str) -> str:
        pattern = sql.lit(f"[?&]{_regex(name)}=([^&#]*)")
        found = decoded(f"regexp_extract({url}, {pattern}, 1)")
        return f"CASE WHEN contains({url}, {sql.lit(name + '=')}) THEN {found} END"

    for name, target in rule.mapping.items():
        at = pointer_parts(target)
        fields = set_subtree(fields, at, {(): Field(at, param(name), TEXT, STRINGS)}, None)
    if rule.click_ids:
        names = "|".join(_regex(p) for p in rule.click_ids)
        pattern = sql.lit(f"[?&]({names})=([^&#]*)")
        some = " OR ".join(f"contains({url}, {sql.lit(p + '=')})" for p in rule.click_ids)
        found = f"CASE WHEN {some} THEN regexp_extract({url}, {pattern}, ['name', 'value']) END"
        found = f"({found})"
        networks = sql.case(
            [(f"{found}.name = {sql.lit(p)}", sql.lit(n)) for p, n in rule.click_ids.items()]
        )
        clickid = decoded(f"{found}.value")
        values = {
            "mkt_clickid": clickid,
            "mkt_network": f"CASE WHEN {clickid} IS NOT NULL THEN {networks} END",
        }
        for name, value in values.items():
            fields = set_subtree(fields, (name,), {(): Field((name,), value, TEXT, STRINGS)}, None)
    return fields


def _regex(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else f"\\{c}" for c in name)


def ip_anonymize(fields: Fields, rule: IpAnonymize) -> Fields:
    at = pointer_parts(rule.field)
    ip = fields.get(at)
    if ip is None:
        return fields
    x = as_text(ip)
    v4 = f"regexp_full_match({x}, '\\d{{1,3}}(\\.\\d{{1,3}}){{3}}')"
    n = rule.octets
    kept = (
        "'0.0.0.0'"
        if n == 4
        else f"regexp_replace({x}, '(\\.\\d{{1,3}}){{{n}}}$', {sql.lit('.0' * n)})"
    )
    v6 = f"{ANONYMIZE_FUNCTION}({x}, {rule.octets}, {rule.segments})"  # the rarer case, in Python
    value = f"CASE WHEN {v4} THEN {kept} WHEN contains({x}, ':') THEN {v6} END"
    return set_subtree(fields, at, {(): Field(at, value, TEXT, STRINGS)}, None)


def pii_pseudonymize(fields: Fields, rule: PiiPseudonymize) -> Fields:
    """Each listed field's leaves hashed; a path through an array (``*``) rewrites the array's
    JSON text."""
    if not os.environ.get(rule.key_env):
        raise PiiKeyMissing(
            f"pii_pseudonymize: the environment variable {rule.key_env} (key_env) holds no key"
        )
    slot = 0  # each field its own cache of digests
    for pointer in rule.fields:
        parts = pointer_parts(pointer)
        if "*" in parts:
            star = parts.index("*")
            array, rest = parts[:star], parts[star:]
            f = fields.get(array)
            if f is None or f.form != RAW:
                continue
            value = f"{HMAC_JSON_FUNCTION}({f.sql}, {sql.lit(json.dumps(list(rest)))})"
            fields = {**fields, array: Field(array, value, RAW, f.kinds)}
            continue
        below = subtree(fields, parts)
        for rest, f in below.items():
            path = (*parts, *rest)
            if f.form == RAW:  # objects and arrays kept whole, or mixed kinds: every value in it
                value = f"{HMAC_JSON_FUNCTION}({f.sql}, '[]')"
                fields[path] = Field(path, value, RAW, f.kinds)
            else:
                value = f"{HMAC_FUNCTION}({as_text(f)}, {slot})"
                slot += 1
                fields[path] = Field(path, value, TEXT, STRINGS)
    return fields


# -- the functions the tasks call -------------------------------------------------------------
def register(con: Any, settings: Mapping[str, Any]) -> None:
    """Make the enrichments' DuckDB functions callable on ``con``."""
    from headwater.pipeline.steps.lookup import arrow_function, map_distinct, sql_type

    arrow_function(
        con,
        BOT_FUNCTION,
        lambda agents: map_distinct(agents, _bot, BOT),
        ["VARCHAR"],
        sql_type(BOT),
    )
    hosts = settings.get(REFERRERS) or {}
    arrow_function(
        con,
        REFERRER_FUNCTION,
        lambda pairs: _referrers(pairs, json.dumps(hosts, sort_keys=True)),
        ["VARCHAR"],
        sql_type(REFERRER),
    )
    arrow_function(
        con,
        ANONYMIZE_FUNCTION,
        lambda ips, octets, segments: _anonymized(ips, octets, segments),
        ["VARCHAR", "INTEGER", "INTEGER"],
        "VARCHAR",
    )
    if "fingerprint" in settings:
        from headwater.pipeline.steps import fingerprint

        fingerprint.register(con, settings["fingerprint"])
    name = settings.get(KEY_ENV)
    if name:
        key = os.environ.get(name, "").encode()
        if not key:
            raise PiiKeyMissing(f"pii_pseudonymize: {name} holds no key in this worker")
        pseudonyms = Pseudonyms(key)
        arrow_function(
            con,
            HMAC_FUNCTION,
            lambda values, slot: pseudonyms.of(values, slot[0].as_py() if len(slot) else 0),
            ["VARCHAR", "INTEGER"],
            "VARCHAR",
        )
        arrow_function(
            con,
            HMAC_JSON_FUNCTION,
            lambda texts, paths: _hashed_json(texts, paths, pseudonyms),
            ["VARCHAR", "VARCHAR"],
            "VARCHAR",
        )


@functools.lru_cache(maxsize=20_000)
def _bot(agent: Any) -> tuple[Any, ...] | None:
    if not isinstance(agent, str) or not agent:
        return None
    import crawleruseragents

    found = crawleruseragents.matching_crawlers(agent)
    if not found:
        return (False, None)
    return (True, crawleruseragents.CRAWLER_USER_AGENTS_DATA[found[0]]["pattern"])


@functools.cache
def _table(hosts_json: str) -> tuple[dict[str, tuple[str, str]], frozenset[str]]:
    """host -> (medium, source), from the built-in list and the config's extra; internal hosts."""
    data = json.loads((Path(__file__).with_name("referrers.json")).read_text())
    extra = json.loads(hosts_json)
    table: dict[str, tuple[str, str]] = {}
    for medium, hosts in [*data.items(), *extra.get("extra", {}).items()]:
        for host, source in hosts.items():
            table[host.lower()] = (medium, source)
    return table, frozenset(h.lower() for h in extra.get("internal", []))


def _referrers(pairs: pa.Array, hosts_json: str) -> pa.Array:
    """Each "referrer URL, unit separator, page host" text's ``REFERRER`` row, every distinct
    one worked out once."""
    from headwater.pipeline.steps.lookup import map_distinct

    table, internal = _table(hosts_json)
    return map_distinct(pairs, lambda t: _referrer(t, table, internal), REFERRER)


@functools.lru_cache(maxsize=20_000)
def _parts(url: str) -> tuple[str, str] | None:
    try:
        split = urlsplit(url.strip())
    except ValueError:
        return None
    host = (split.hostname or "").lower()
    return (host, split.path or "/") if host else None


def _referrer(
    pair: Any, table: dict[str, tuple[str, str]], internal: frozenset[str]
) -> tuple[Any, ...] | None:
    if not isinstance(pair, str):
        return None
    url, _, own = pair.partition(chr(31))
    found = _parts(url) if url else None
    if found is None:
        return None
    host, path = found
    if host in internal or (own and own == host):
        return (host, path, "internal", None)
    probe = host
    while probe:
        hit = table.get(probe) or table.get(probe.removeprefix("www."))
        if hit is not None:
            return (host, path, hit[0], hit[1])
        probe = probe.partition(".")[2]  # news.google.com -> google.com -> com
    return (host, path, "unknown", None)


def _anonymized(ips: pa.Array, octets: pa.Array, segments: pa.Array) -> pa.Array:
    o = octets[0].as_py() if len(octets) else 1
    s = segments[0].as_py() if len(segments) else 4
    from headwater.pipeline.steps.lookup import map_distinct

    got = map_distinct(ips, lambda ip: _anonymize(ip, o, s), (("ip", pa.string()),))
    return got.field("ip")


def _anonymize(ip: Any, octets: int, segments: int) -> tuple[str | None] | None:
    if not isinstance(ip, str):
        return None
    try:
        address = ipaddress.ip_address(ip.strip())
    except ValueError:
        return (None,)  # not an address: nothing of it kept
    bits = 8 * octets if address.version == 4 else 16 * segments
    width = address.max_prefixlen
    masked = int(address) & ~((1 << min(bits, width)) - 1)
    return (str(type(address)(masked)),)


def _digest(pseudonyms: Pseudonyms, value: Any) -> str | None:
    return None if value is None else pseudonyms.known(str(value), pseudonyms.cache(-1))


def _hashed_json(texts: pa.Array, paths: pa.Array, pseudonyms: Pseudonyms) -> pa.Array:
    path = json.loads(paths[0].as_py()) if len(paths) else []
    from headwater.pipeline.steps.lookup import map_distinct

    def one(text: Any) -> tuple[str | None] | None:
        if not isinstance(text, str):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return (_digest(pseudonyms, text),)
        return (json.dumps(_hash_at(value, path, pseudonyms), separators=(",", ":")),)

    return map_distinct(texts, one, (("h", pa.string()),)).field("h")


def _hash_at(value: Any, path: list[str], pseudonyms: Pseudonyms) -> Any:
    """``value`` with every scalar at ``path`` (``*``: each item) below it hashed."""
    if not path:
        if isinstance(value, dict):
            return {k: _hash_at(v, [], pseudonyms) for k, v in value.items()}
        if isinstance(value, list):
            return [_hash_at(v, [], pseudonyms) for v in value]
        text = value if isinstance(value, str) else json.dumps(value)
        return None if value is None else _digest(pseudonyms, text)
    head, rest = path[0], path[1:]
    if head == "*" and isinstance(value, list):
        return [_hash_at(v, rest, pseudonyms) for v in value]
    if isinstance(value, dict) and head in value:
        return {**value, head: _hash_at(value[head], rest, pseudonyms)}
    return value
