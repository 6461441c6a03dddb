"""Step 3, lookup enrichment rules (seed 002, "LookupEnrichment step"): ``ip_lookup`` and
``user_agent_parse`` read a field of the event and write an object at another.

Besides the configured rules, events from JavaScript (browser SDKs: the ``segment`` and
``jitsu`` intakes with a browser's ``Mozilla/...`` user agent) get the seed's two implicit
rules: ``/source_ip`` -> ``/eventn_ctx/location`` (when a geo database is configured) and
``/eventn_ctx/user_agent`` -> ``/eventn_ctx/parsed_ua``.

Each rule is one call of a lookup function (``headwater.pipeline.steps.lookup``) per event,
computed once in a column of its own (``Lookup``); its result's fields become the event's fields
under the rule's ``dst`` where the lookup found something, and what was there stays where it
found nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from headwater.bus import context
from headwater.errors import ConfigError
from headwater.pipeline import sql
from headwater.pipeline.columns import header, pointer_parts
from headwater.pipeline.enrichment_config import EnrichmentRule, LookupRule
from headwater.pipeline.fields import BOOLEAN, DOUBLE, TEXT, Field, Fields, as_text, set_subtree
from headwater.pipeline.shape import BOOL, FLOAT64, STRING
from headwater.pipeline.steps import lookup

IMPLICIT = (
    LookupRule(name="ip_lookup", src="/source_ip", dst="/eventn_ctx/location"),
    LookupRule(name="user_agent_parse", src="/eventn_ctx/user_agent", dst="/eventn_ctx/parsed_ua"),
)
LOOKUPS = ("ip_lookup", "user_agent_parse")
ORDER = ("bot_detect", "referrer", "campaign", "ip_anonymize", "pii_pseudonymize", "fingerprint")
"""The other enrichments run after the lookups, in this order (``steps.enrichments``)."""
HEADERS = (context.PROTOCOL, context.USER_AGENT)
_FORMS = {pa.string(): (TEXT, STRING), pa.float64(): (DOUBLE, FLOAT64), pa.bool_(): (BOOLEAN, BOOL)}


@dataclass(frozen=True)
class Drop:
    """Events an enrichment discards (counted as skipped): where ``condition`` (SQL) is true."""

    condition: str
    what: str  # names the enrichment, for the docs and the log


@dataclass
class Enriched:
    """What the enrichments make of the fields: the fields after them, the lookup calls they
    read (in order), the events they discard, and the settings the task's functions need
    (plain JSON data: it travels in the program)."""

    fields: Fields
    lookups: list[Lookup]
    drops: list[Drop] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Lookup:
    """One lookup call per event: ``column := function(argument)``."""

    column: str
    function: str
    argument: str  # SQL over the fields as they are before this rule


def is_javascript() -> str:
    protocol = sql.ident(header(context.PROTOCOL))
    agent = sql.ident(header(context.USER_AGENT))
    return (
        f"({protocol} IN ('segment', 'jitsu') AND starts_with(COALESCE({agent}, ''), 'Mozilla/'))"
    )


def apply(
    fields: Fields,
    rules: list[EnrichmentRule],
    geoip_database: Path | None,
    fingerprints: Path | None = None,
) -> Enriched:
    """``fields`` with every rule's result, and the lookup calls they read (in order: a rule
    may read what an earlier one wrote); ``fingerprints``: the fingerprint store's default file."""
    calls: list[Lookup] = []
    lookups = [r for r in rules if isinstance(r, LookupRule)]
    for rule, implicit in [(r, False) for r in lookups] + [(r, True) for r in IMPLICIT]:
        if rule.name == "ip_lookup" and geoip_database is None:
            if implicit:
                continue
            raise ConfigError("an ip_lookup rule needs pipeline.geoip_database")
        source = fields.get(pointer_parts(rule.src))
        if source is None:  # no event of the shape has the input
            continue
        argument = as_text(source)
        if implicit:
            argument = f"CASE WHEN {is_javascript()} THEN {argument} END"
        geo = rule.name == "ip_lookup"
        call = Lookup(
            f"_hw_l{len(calls)}",
            lookup.GEO_FUNCTION if geo else lookup.USER_AGENT_FUNCTION,
            argument,
        )
        calls.append(call)
        column = sql.ident(call.column)
        dst = pointer_parts(rule.dst)
        result: Fields = {}
        for name, arrow_type in lookup.GEO if geo else lookup.USER_AGENT:
            form, kind = _FORMS[arrow_type]
            path = (*dst, name)
            result[(name,)] = Field(path, f"{column}.{sql.ident(name)}", form, frozenset({kind}))
        fields = set_subtree(fields, dst, result, f"({column} IS NOT NULL)")
    enriched = Enriched(fields, calls)
    for name in ORDER:
        for rule in rules:
            if rule.name == name:
                _enrich(enriched, rule, fingerprints)
    return enriched


def _enrich(out: Enriched, rule: Any, fingerprints: Path | None) -> None:
    """``rule`` (one of ``ORDER``) applied to ``out``."""
    from headwater.pipeline.steps import enrichments as en

    column = f"_hw_l{len(out.lookups)}"
    if rule.name == "bot_detect":
        out.fields, argument, bot = en.bot_detect(out.fields, rule, column)
        if argument is not None:
            out.lookups.append(Lookup(column, en.BOT_FUNCTION, argument))
            if rule.drop_bots:
                out.drops.append(Drop(bot, "bot_detect"))
    elif rule.name == "referrer":
        out.fields, argument = en.referrer(out.fields, rule, column)
        if argument is not None:
            out.lookups.append(Lookup(column, en.REFERRER_FUNCTION, argument))
            hosts = {"extra": rule.extra, "internal": rule.internal_hosts}
            out.settings[en.REFERRERS] = hosts
    elif rule.name == "campaign":
        out.fields = en.campaign(out.fields, rule)
    elif rule.name == "ip_anonymize":
        out.fields = en.ip_anonymize(out.fields, rule)
        out.settings["ip_anonymize"] = True  # its function is registered
    elif rule.name == "pii_pseudonymize":
        out.fields = en.pii_pseudonymize(dict(out.fields), rule)
        out.settings[en.KEY_ENV] = rule.key_env
    elif rule.name == "fingerprint":
        from headwater.pipeline.steps import fingerprint as fp

        argument = fp.argument(out.fields, rule)
        store = rule.store or fingerprints
        if store is None:
            raise ConfigError("a fingerprint rule needs store (no default folder is known here)")
        if argument is not None:
            out.lookups.append(Lookup(column, fp.FUNCTION, argument))
            out.drops.append(Drop(f"COALESCE({sql.ident(column)}, false)", "fingerprint"))
            out.settings[fp.SETTINGS] = {"store": str(store), "window_s": rule.window_s}
