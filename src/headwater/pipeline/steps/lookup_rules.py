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
from pyspark.sql.types import StructType

from headwater.bus import context
from headwater.pipeline.columns import EVENT, header, pointer_parts, with_event
from headwater.pipeline.config import EnrichmentRule
from headwater.pipeline.structs import get_path, set_path, type_at

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
        struct = df.schema[EVENT].dataType
        assert isinstance(struct, StructType)
        source = get_path(F.col(EVENT), struct, pointer_parts(rule.src))
        if source is None:  # no event of the shape has the input
            continue
        if implicit:
            source = F.when(js, source)
        df = df.withColumn(LOOKED_UP, _lookup(rule, source.cast("string"), geoip_database))
        result = F.col(LOOKED_UP)
        event = F.col(EVENT)
        dst = pointer_parts(rule.dst)
        previous = get_path(event, struct, dst)
        result_type = df.schema[LOOKED_UP].dataType
        # where the lookup finds nothing, what was there stays (when it is the same kind)
        same = previous is not None and type_at(struct, dst) == result_type
        value = F.coalesce(result, previous) if same and previous is not None else result
        df = with_event(df, set_path(event, struct, dst, value))
    return df.drop(LOOKED_UP)


def _lookup(rule: EnrichmentRule, source: Column, geoip_database: Path | None) -> Column:
    from headwater.pipeline.steps import lookup

    if rule.name == "ip_lookup":
        assert geoip_database is not None
        return lookup.geo_lookup(source, geoip_database)
    return lookup.parse_user_agent(source)
