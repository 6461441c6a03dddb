"""pytest fixtures for the real services headwater's tests use (registered as a pytest plugin).

Each service is started once per test session, and only when a test asks for its fixture:

- ``postgres_service``: a throwaway PostgreSQL 15 cluster (:class:`PostgresService`)
- ``redis_service``: a throwaway Redis server (:class:`RedisService`)
- ``s3_server``: a throwaway S3-compatible server, SeaweedFS (:class:`S3Service`)
- ``kafka_broker``: one Apache Kafka broker in KRaft mode (:class:`KafkaCluster`)
- ``spark``: one local-mode SparkSession for the whole run (with Spark's Kafka connector)
- ``browser`` and ``page``: Debian's Chromium driven by Playwright (``headwater.testing.browser``)

and ``no_headwater_env``, for a test that reads configuration: no ``HEADWATER_*`` variable of
the environment the tests run in overrides what the test sets.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from headwater.testing.browser import browser, page

if TYPE_CHECKING:
    from headwater.testing.kafka import KafkaCluster
    from headwater.testing.postgres import PostgresService
    from headwater.testing.redis import RedisService
    from headwater.testing.s3 import S3Service


@pytest.fixture
def no_headwater_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every ``HEADWATER_*`` variable from the environment for the test."""
    for name in list(os.environ):
        if name.startswith("HEADWATER_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def postgres_service() -> Iterator[PostgresService]:
    """A PostgreSQL cluster on a free loopback port, shared by the whole session."""
    from headwater.testing.postgres import start_postgres

    with start_postgres() as service:
        yield service


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RedisService]:
    """A Redis server on a free loopback port, shared by the whole session."""
    from headwater.testing.redis import start_redis

    with start_redis() as service:
        yield service


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Service]:
    """An S3-compatible server (SeaweedFS) on free loopback ports, shared by the whole session;
    requests must be signed with its ``access_key`` and ``secret_key``."""
    from headwater.testing.s3 import start_s3

    with start_s3() as service:
        yield service


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaCluster]:
    """One Apache Kafka broker on free loopback ports, shared by the whole session."""
    from headwater.testing.kafka import start_kafka

    with start_kafka() as service:
        yield service


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The test session's one SparkSession (local[2]), with headwater's data source and Spark's
    Kafka connector (so a Kafka bus is read by the connector, as ``headwater pipeline`` reads
    it)."""
    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import spark_session

    config = SparkConfig(master="local[2]")
    session = spark_session(config, app_name="headwater-tests", kafka=True)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The data folder of this process's embedded ClickHouse (chdb allows one per process);
    tests keep apart by database."""
    return tmp_path_factory.mktemp("chdb")


__all__ = ["browser", "page"]
