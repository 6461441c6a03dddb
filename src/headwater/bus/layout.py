"""The column layout of Spark's Kafka source, which every bus backend's records take in Arrow
(``headwater.bus.arrow``) and the pipeline's Spark source declares: as Spark SQL DDL, with no
import of Arrow (the processes in which Spark plans a read need only the DDL)."""

from __future__ import annotations

SCHEMA_DDL = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "timestampType int, headers array<struct<key:string,value:binary>>"
)
CREATE_TIME = 0  # Kafka's timestampType for a producer-set (here: append-time) timestamp
