"""The scale-out layout end to end, all on loopback: a three-broker Apache Kafka cluster
(replication factor 3, ``min.insync.replicas`` 2), two ``headwater collector`` processes with
durable acks, a Spark standalone master with two workers, and ``headwater pipeline --master
spark://...`` reading through Spark's Kafka connector into PostgreSQL, on a topic of six
partitions.

Clients send Segment batches to both collectors (a client whose collector is gone moves to the
other, as behind a load balancer; a batch without an ack is not sent again). At random moments
during the load one broker, one Spark worker and one collector are SIGKILLed. At the end every
event of every acked batch is in PostgreSQL exactly once, and nothing is there that was not sent.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psycopg
import pytest
import yaml

from headwater.bus import open_bus
from headwater.collector.auth import hash_key
from headwater.config.model import HeadwaterConfig
from headwater.testing.clients import http_exchange
from headwater.testing.collector import CollectorProcess
from headwater.testing.crash_load import (
    REPLY_TIMEOUT_S,
    WRITE_KEY,
    Ledger,
    post,
    segment_batch,
    segment_ok,
)
from headwater.testing.kafka import KafkaCluster, start_kafka
from headwater.testing.postgres import PostgresService
from headwater.testing.spark_cluster import SparkCluster, start_spark_cluster

TOPIC = "events-track"
PARTITIONS = 6
CLIENTS_PER_COLLECTOR = 2
LOAD_S = 60.0
KILL_WINDOW_S = (8.0, 45.0)  # each kill lands at a random moment in this part of the load
LAND_DEADLINE_S = 300.0  # for every acked event to be in PostgreSQL after the load
Kill = tuple[float, str, Callable[[], None]]  # when into the load, what, how


class Landed(NamedTuple):
    """A kill as it happened: when into the load, what, the batches acked before it and the
    requests in flight at that moment."""

    at: float
    what: str
    acked_before: int
    in_flight: int


pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(1200)]


def write_config(tmp_path: Path, kafka: KafkaCluster, dsn: str) -> Path:
    path = tmp_path / "headwater.yaml"
    config = {
        "data_dir": str(tmp_path / "data"),
        "bus": {
            "backend": "kafka",
            "kafka": {
                "bootstrap_servers": kafka.bootstrap_servers,
                "default_partitions": PARTITIONS,
                "replication_factor": 3,
                "timeout_s": 30.0,
            },
        },
        "collector": {
            "ack": "durable",
            "admission": {"min_free_disk_bytes": None},
            "sources": [{"id": "e2e", "write_keys": [hash_key(WRITE_KEY)]}],
        },
        "pipeline": {
            "destinations": [
                {
                    "id": "pg",
                    "type": "postgres",
                    "dsn": dsn,
                    "mode": "stream",
                    "trigger_interval_s": 2.0,
                    "topics": [TOPIC],
                }
            ]
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def start_pipeline(config_file: Path, master: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    command = [sys.executable, "-m", "headwater", "--config", str(config_file), "pipeline"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "--master", master],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )


class Balancer:
    """The collectors' ports, as a load balancer sees them: a client takes a live one."""

    def __init__(self, collectors: list[CollectorProcess], ports: list[int]) -> None:
        self.collectors = collectors
        self.ports = ports

    def port(self, preferred: int) -> int | None:
        order = [preferred, *(i for i in range(len(self.ports)) if i != preferred)]
        for i in order:
            if self.collectors[i].proc.poll() is None:
                return self.ports[i]
        return None


async def client(ledger: Ledger, balancer: Balancer, k: int, stop: asyncio.Event) -> None:
    """Send Segment batches until ``stop``; a batch without an ack is given up, not resent."""
    auth = base64.b64encode(f"{WRITE_KEY}:".encode()).decode()
    seq = 0
    while not stop.is_set():
        port = balancer.port(k % len(balancer.ports))
        if port is None:
            return
        batch, body = segment_batch(ledger, f"c{k}-{seq}")
        seq += 1
        request = post(
            port, "/v1/batch", "application/json", body, f"Authorization: Basic {auth}\r\n"
        )
        try:
            resp = await http_exchange("127.0.0.1", port, request, REPLY_TIMEOUT_S * 3)
        except OSError:
            resp = None
        ok = resp is not None and segment_ok(resp.status, resp.body)
        ledger.answered(batch.id, ok)
        if not ok:
            await asyncio.sleep(0.05)  # the balancer notices a dead collector: not a busy loop


async def load_with_kills(
    ledger: Ledger,
    balancer: Balancer,
    kills: list[Kill],
) -> tuple[list[Landed], int]:
    """Run the clients for ``LOAD_S`` and the kills at their moments; when each landed (with
    the batches acked before it and those in flight at it), and how many batches were acked
    after the last one."""
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(client(ledger, balancer, k, stop))
        for k in range(CLIENTS_PER_COLLECTOR * len(balancer.ports))
    ]
    start = time.monotonic()
    done: list[Landed] = []
    for at, what, kill in sorted(kills, key=lambda k: k[0]):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        acked_before, in_flight = len(ledger.acked), len(ledger.unanswered)
        kill()
        done.append(Landed(time.monotonic() - start, what, acked_before, in_flight))
    after_kills = len(ledger.acked)
    await asyncio.sleep(max(0.0, start + LOAD_S - time.monotonic()))
    stop.set()
    await asyncio.gather(*clients)
    return done, len(ledger.acked) - after_kills


def acked_events(ledger: Ledger) -> set[str]:
    return {eid for bid in ledger.acked for eid in ledger.batches[bid].event_ids}


def landed(dsn: str) -> Counter[str]:
    with psycopg.connect(dsn) as conn:
        exists = conn.execute("select to_regclass('public.events')").fetchone()
        if exists is None or exists[0] is None:
            return Counter()
        rows = conn.execute("select id from events").fetchall()
    return Counter(str(r[0]) for r in rows)


def wait_landed(dsn: str, wanted: set[str], pipeline: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + LAND_DEADLINE_S
    missing = len(wanted)
    while time.monotonic() < deadline:
        assert pipeline.poll() is None, f"the pipeline exited:\n{log.read_text()[-4000:]}"
        missing = len(wanted - set(landed(dsn)))
        if not missing:
            return
        time.sleep(1.0)  # polling PostgreSQL for a condition, with a deadline
    raise AssertionError(
        f"{missing} acked events not in PostgreSQL in time:\n{log.read_text()[-4000:]}"
    )


def test_acked_events_land_once_through_broker_worker_and_collector_kills(
    tmp_path: Path, postgres_service: PostgresService
) -> None:
    seed = int.from_bytes(os.urandom(4))
    print(f"cluster e2e seed {seed}")  # shown when the test fails
    rng = random.Random(seed)
    ledger = Ledger(rng)
    dsn = postgres_service.fresh_database("cluster_e2e")
    with start_kafka(brokers=3) as kafka, start_spark_cluster(workers=2) as spark_cluster:
        config_file = write_config(tmp_path, kafka, dsn)
        config = HeadwaterConfig.model_validate(yaml.safe_load(config_file.read_text()))
        with open_bus(config) as bus:
            bus.create_topic(TOPIC, PARTITIONS)
            assert bus.topic(TOPIC).replication_factor == 3
        collectors = [
            CollectorProcess(config_file, tmp_path / f"collector-{i}.err") for i in (0, 1)
        ]
        pipeline_log = tmp_path / "pipeline.log"
        pipeline = start_pipeline(config_file, spark_cluster.url, pipeline_log)
        try:
            ports = [c.wait_healthy() for c in collectors]
            kills = kill_plan(rng, kafka, spark_cluster, collectors)
            balancer = Balancer(collectors, ports)
            landed_kills, acked_since = asyncio.run(load_with_kills(ledger, balancer, kills))
            gave_up = len(ledger.batches) - len(ledger.acked)
            print("kills:", landed_kills, "then", acked_since, "acked;", gave_up, "given up")
            assert acked_since > 100, f"no recovery after the kills {landed_kills}: {acked_since}"
            wanted = acked_events(ledger)
            assert len(wanted) > 2000, f"too little was acked to mean much: {len(wanted)}"
            wait_landed(dsn, wanted, pipeline, pipeline_log)
            pipeline.send_signal(signal.SIGTERM)
            assert pipeline.wait(timeout=120) == 0, pipeline_log.read_text()[-4000:]
        finally:
            if pipeline.poll() is None:
                os.killpg(pipeline.pid, signal.SIGKILL)
                pipeline.wait(30)
            for c in collectors:
                c.close()
        assert spark_cluster.alive_workers() == 1
        assert len(kafka.alive()) == 2
    rows = landed(dsn)
    twice = [eid for eid, n in rows.items() if n > 1]
    assert not twice, f"seed {seed}: events in PostgreSQL more than once: {twice[:10]}"
    unknown = [eid for eid in rows if eid not in ledger.events]
    assert not unknown, f"seed {seed}: rows that were never sent: {unknown[:10]}"
    assert wanted <= set(rows)
    # each kill landed in the load: batches acked before it, requests in flight at it (and, from
    # acked_since, many acked after the last). A request in flight at a collector's kill may still
    # be acked: its intake workers outlive the main process by a few milliseconds and produce to
    # Kafka themselves, so a batch given up is not a property to assert.
    for kill in landed_kills:
        assert kill.acked_before > 0 and kill.in_flight > 0, f"outside the load: {kill}"


def kill_plan(
    rng: random.Random,
    kafka: KafkaCluster,
    spark_cluster: SparkCluster,
    collectors: list[CollectorProcess],
) -> list[Kill]:
    broker = rng.randrange(len(kafka.nodes))
    worker = rng.randrange(len(spark_cluster.workers))
    collector = rng.randrange(len(collectors))

    def kill_worker() -> None:
        os.kill(spark_cluster.workers[worker].pid, signal.SIGKILL)

    return [
        (rng.uniform(*KILL_WINDOW_S), f"broker {broker + 1}", lambda: kafka.kill(broker)),
        (rng.uniform(*KILL_WINDOW_S), f"spark worker {worker}", kill_worker),
        (rng.uniform(*KILL_WINDOW_S), f"collector {collector}", collectors[collector].kill),
    ]
