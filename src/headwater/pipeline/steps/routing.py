"""Step 4, routing: which events a destination takes, and into which table.

The destination's topic filter is applied by its source (topics or topic_pattern). Here the
table name template is evaluated per event: the result goes to ``_hw_table``; an empty result
skips the event for this destination (``_hw_table`` is ""); an evaluation error fails it
(``HW-PIPE-201``, with the template's reason).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.pipeline.columns import ERROR, EVENT, TABLE, failure
from headwater.pipeline.steps.template import compile_template

STEP = "route"
TEMPLATE_FAILED = "HW-PIPE-201"


def route(df: DataFrame, table_name_template: str) -> DataFrame:
    """Add ``_hw_table`` (and ``_hw_error`` where the template could not be evaluated)."""
    compiled = compile_template(table_name_template, df.schema[EVENT].dataType)
    live = F.col(ERROR).isNull() & F.col(EVENT).isNotNull()
    error = F.when(F.col(ERROR).isNotNull(), F.col(ERROR)).when(
        live & compiled.error.isNotNull(), failure(STEP, TEMPLATE_FAILED, compiled.error)
    )
    return df.withColumn(TABLE, F.when(live, compiled.name)).withColumn(ERROR, error)
