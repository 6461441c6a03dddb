"""Step 3, lookup enrichment rules (seed 002, "LookupEnrichment step"): ``ip_lookup`` and
``user_agent_parse`` read a field of the event and write an object at another.

Besides the configured rules, events from JavaScript (browser SDKs: the ``segment`` and
``jitsu`` intakes with a browser's ``Mozilla/...`` user agent) get the seed's two implicit
rules: ``/source_ip`` -> ``/eventn_ctx/location`` (when a geo database is configured) and
``/eventn_ctx/user_agent`` -> ``/eventn_ctx/parsed_ua``.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline.columns import EVENT, header, json_path, pointer_parts, with_event
from headwater.pipeline.config import EnrichmentRule

LOOKED_UP = "_hw_lookup"
IMPLICIT = (
    EnrichmentRule(name="ip_lookup", src="/source_ip", dst="/eventn_ctx/location"),
    EnrichmentRule(
        name="user_agent_parse", src="/eventn_ctx/user_agent", dst="/eventn_ctx/parsed_ua"
    ),
)


def is_javascript() -> Column:
    protocol = header(context.PROTOCOL)
    agent = F.coalesce(header(context.USER_AGENT), F.lit(""))
    return protocol.isin("segment", "jitsu") & agent.startswith("Mozilla/")


def apply_lookups(
    df: DataFrame, rules: list[EnrichmentRule], geoip_database: Path | None
) -> DataFrame:
    """``event`` with every rule's result set (rules whose input is missing leave it as is)."""
    js = is_javascript()
    for rule, implicit in [(r, False) for r in rules] + [(r, True) for r in IMPLICIT]:
        if rule.name == "ip_lookup" and geoip_database is None:
            if implicit:
                continue
            from headwater.errors import ConfigError

            raise ConfigError("an ip_lookup rule needs pipeline.geoip_database")
        event = F.col(EVENT)
        df = df.withColumn(LOOKED_UP, _lookup(rule, event, geoip_database))
        result = F.col(LOOKED_UP)
        updated = F.when(result.isNull(), event).otherwise(
            F.variant_set(event, json_path(pointer_parts(rule.dst)), F.to_variant_object(result))
        )
        df = with_event(df, F.when(js, updated).otherwise(event) if implicit else updated)
    return df.drop(LOOKED_UP)


def _lookup(rule: EnrichmentRule, event: Column, geoip_database: Path | None) -> Column:
    from headwater.pipeline.steps import lookup

    source = F.try_variant_get(event, json_path(pointer_parts(rule.src)), "string")
    if rule.name == "ip_lookup":
        assert geoip_database is not None
        return lookup.geo_lookup(source, geoip_database)
    return lookup.parse_user_agent(source)
