"""Fixtures of the transport tests: scratch databases on the session's PostgreSQL (slots and
publications are per database; slots, per cluster, are dropped after each test)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tests.transport.pg_source import drop_slots

from headwater.testing.postgres import PostgresService


@pytest.fixture
def source(postgres_service: PostgresService) -> Iterator[str]:
    """The DSN of a fresh source database."""
    dsn = postgres_service.fresh_database(f"src_{time.monotonic_ns()}")
    yield dsn
    drop_slots(dsn)


@pytest.fixture
def dsn(source: str) -> str:
    """The source database, where a test has no other."""
    return source


@pytest.fixture
def target(postgres_service: PostgresService) -> str:
    """The DSN of a fresh database for a PostgreSQL mirror."""
    return postgres_service.fresh_database(f"dst_{time.monotonic_ns()}")
