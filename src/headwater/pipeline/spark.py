"""The one SparkSession of a headwater process, built from ``pipeline.spark``.

Local mode binds to loopback and runs the Python workers on this interpreter unless
``PYSPARK_PYTHON`` says otherwise. The PostgreSQL JDBC driver is put on the classpath when the
Debian package's jar is there, and Spark's Kafka connector (fetched once from Maven Central, see
:mod:`headwater.jvm.maven`) when the bus is Kafka. headwater's Spark data source
(``format("headwater")``) is registered on every session this module builds.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyarrow as pa
    from pyspark.sql import SparkSession

    from headwater.pipeline.config import SparkConfig

POSTGRES_JDBC_JAR = Path("/usr/share/java/postgresql.jar")
_LOCK = threading.Lock()

# Settings for a small local Spark: few shuffle partitions, Arrow transfers, UTC everywhere.
_DEFAULTS = {
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.streaming.stopGracefullyOnShutdown": "true",
    # PySpark records the Python call site of every Column function for error messages: a
    # py4j round trip per call, a third of the time a micro-batch's plan took to build
    "spark.python.sql.dataFrameDebugging.enabled": "false",
    "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
}

# Local mode runs everything in the driver's JVM. No event passes through it (the sink's tasks
# read their ranges of the log and stage rows from Python workers), so a small heap is ample
# whatever the batch size (Spark refuses less than ~450 MB).
_LOCAL_DEFAULTS = {"spark.driver.memory": "512m"}


def extra_jars(config: SparkConfig) -> str:
    """``spark.jars``: the configured ones, else the PostgreSQL JDBC driver when installed."""
    if "spark.jars" in config.conf:
        return config.conf["spark.jars"]
    return str(POSTGRES_JDBC_JAR) if POSTGRES_JDBC_JAR.exists() else ""


def kafka_connector_jars() -> list[str]:
    """Spark's Kafka connector and the dependencies Spark does not ship itself (Scala, Hadoop,
    compression codecs are Spark's own), at the installed PySpark's version (fetched with ``mvn``
    the first time)."""
    from pyspark.find_spark_home import _find_spark_home

    from headwater.jvm.maven import fetch, spark_kafka_connector, unversioned

    shipped = {unversioned(j) for j in (Path(_find_spark_home()) / "jars").glob("*.jar")}
    jars = fetch(spark_kafka_connector(), quiet=False)
    return [str(j) for j in jars if unversioned(j) not in shipped]


def settings(config: SparkConfig, kafka: bool = False) -> dict[str, str]:
    """Every setting the session is built with: ours, then the configured ones on top. With
    ``kafka``, Spark's Kafka connector is added to ``spark.jars``."""
    local = config.master.startswith("local")
    out = {**_DEFAULTS, **(_LOCAL_DEFAULTS if local else {})}
    jars = extra_jars(config)
    every = [j for j in jars.split(",") if j]
    if kafka and "spark.jars" not in config.conf:
        every += kafka_connector_jars()
    if every:
        out["spark.jars"] = ",".join(every)
    if local:  # the driver is the whole cluster: start it fast (headwater.pipeline.driver_jvm)
        from headwater.pipeline.driver_jvm import driver_options

        # keyed by the default jars: spark.jars are loaded by Spark's own class loader, not
        # from the JVM's class path that the archive depends on
        options = " ".join(driver_options(jars, heavy=kafka))
        out["spark.driver.extraJavaOptions"] += f" {options}"
    return {**out, **config.conf}


def spark_session(
    config: SparkConfig, app_name: str = "headwater", *, kafka: bool = False
) -> SparkSession:
    """The process's SparkSession (created on first use, then reused); ``kafka``: with Spark's
    Kafka connector (give ``config.bus.backend == "kafka"``)."""
    from pyspark.sql import SparkSession

    with _LOCK:
        if config.master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = SparkSession.builder.master(config.master).appName(app_name)
        for key, value in settings(config, kafka).items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        _register_sources(session)
        threading.Thread(
            target=warm_workers, args=(session,), name="warm-python-workers", daemon=True
        ).start()
        return session


def warm_workers(session: SparkSession) -> None:
    """Start the executors' Python workers and load what the pipeline's tasks need (one task
    per core, in the background): a cold worker takes a second or more to import it all, which
    a first micro-batch (``headwater pipeline --once``) would otherwise wait for."""
    import logging

    cores = session.sparkContext.defaultParallelism
    try:
        session.range(0, cores, 1, cores).mapInArrow(_warm, "id long").collect()
    except Exception:  # only a head start: the pipeline's own jobs say what is wrong
        logging.getLogger(__name__).debug("warming the Python workers failed", exc_info=True)


def _warm(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from headwater.pipeline import sink

    sink.warm()
    for batch in batches:
        yield batch.slice(0, 0)


def _register_sources(session: SparkSession) -> None:
    from headwater.pipeline import source

    source.register(session)
