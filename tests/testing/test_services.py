"""The service starters in headwater.testing really start their service, and clean up after."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from headwater.testing.postgres import PostgresService, start_postgres
from headwater.testing.redis import RedisService, RedisStartError, start_redis


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an unreaped zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


# --- PostgreSQL -----------------------------------------------------------------------------


def test_postgres_runs_sql(postgres_service: PostgresService) -> None:
    psycopg = pytest.importorskip("psycopg")
    assert postgres_service.host == "127.0.0.1"
    assert postgres_service.dsn == (
        f"postgresql://{postgres_service.user}@127.0.0.1:{postgres_service.port}/headwater"
    )
    table = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_service.dsn, autocommit=True) as conn:
        assert conn.execute("select current_database()").fetchone() == ("headwater",)
        conn.execute(f"create table {table} (id int primary key, body text)")
        conn.execute(f"insert into {table} values (1, 'one'), (2, 'two')")
        rows = conn.execute(f"select id, body from {table} order by id").fetchall()
        conn.execute(f"drop table {table}")
    assert rows == [(1, "one"), (2, "two")]


def test_postgres_is_stopped_and_removed_on_exit() -> None:
    with start_postgres() as pg:
        assert _running(pg.pid)
        assert pg.data_dir.is_dir()
        assert _accepts_connections(pg.host, pg.port)
    assert not _running(pg.pid)
    assert not pg.data_dir.exists()
    assert not pg.data_dir.parent.exists()
    assert not _accepts_connections(pg.host, pg.port)


def test_postgres_is_stopped_when_the_test_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), start_postgres() as pg:
        raise RuntimeError("boom")
    assert not _running(pg.pid)
    assert not pg.data_dir.parent.exists()


# --- Redis ----------------------------------------------------------------------------------


def test_redis_ping_set_get(redis_service: RedisService) -> None:
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(redis_service.url)
    try:
        assert client.ping() is True
        client.set("headwater:test", b"value")
        assert client.get("headwater:test") == b"value"
        assert client.info("server")["process_id"] == redis_service.pid
    finally:
        client.close()


def test_redis_is_stopped_and_removed_on_exit() -> None:
    with start_redis() as r:
        assert _running(r.pid)
        assert r.data_dir.is_dir()
        assert _accepts_connections(r.host, r.port)
    assert not _running(r.pid)
    assert not r.data_dir.exists()
    assert not _accepts_connections(r.host, r.port)


def test_redis_failure_to_start_is_reported_with_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fake redis refuses to start' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HW_REDIS_SERVER", str(fake))
    with (
        pytest.raises(RedisStartError, match=r"(?s)exited with code 3.*refuses to start"),
        start_redis(),
    ):
        pass  # pragma: no cover


# --- Kafka-protocol broker ------------------------------------------------------------------


@pytest.mark.kafka
def test_broker_answers_metadata(kafka_broker) -> None:
    admin_module = pytest.importorskip("confluent_kafka.admin")
    admin = admin_module.AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    metadata = admin.list_topics(timeout=15)
    assert metadata.brokers, "the broker listed no brokers in its metadata"


@pytest.mark.kafka
def test_broker_is_stopped_on_exit() -> None:
    from headwater.testing.kafka import HOST, start_kafka

    with start_kafka() as kafka:
        pid, port = kafka.process.pid, kafka.nodes[0].port
        folder = kafka.nodes[0].directory
        assert _running(pid)
        assert _accepts_connections(HOST, port)
        assert (folder / "data" / "meta.properties").exists()
    assert not _running(pid)
    assert not _accepts_connections(HOST, port)
    assert not folder.exists()
