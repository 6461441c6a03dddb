"""Start throwaway Apache Kafka brokers (KRaft mode) on loopback for tests and benchmarks.

The broker is Apache Kafka itself (``org.apache.kafka:kafka_2.13``, fetched once from Maven
Central by :mod:`headwater.jvm.maven`), each node both broker and controller, its data in a
temporary folder that is removed when the context exits::

    with start_kafka() as kafka:                       # one broker
        Producer({"bootstrap.servers": kafka.bootstrap_servers})
    with start_kafka(brokers=3) as kafka:              # replication 3, min.insync.replicas 2
        kafka.kill(1); ...; kafka.restart(1)           # SIGKILL a broker, start it again

With three or more brokers, topics default to replication factor 3 and ``min.insync.replicas``
2, the settings a durable production cluster uses. ``flush_messages`` sets the broker's
``log.flush.interval.messages`` (1: every append is fsync'd before it is acknowledged; by default
Kafka leaves flushing to the OS and counts on replication).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from headwater.jvm.maven import KAFKA_BROKER, classpath, fetch
from headwater.testing._service import stop_process, tail, wait_ready
from headwater.testing.ports import free_port

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
_FORMAT_TIMEOUT_S = 120.0
_ATTEMPTS = 3  # fresh ports and folder each time
# A broker's JVM: a small heap that grows as needed; C1 only unless told otherwise (tests start
# many brokers and their work is light; a benchmark passes its own options)
JVM_OPTIONS = ("-Xms64m", "-Xmx768m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
_LOG4J = """\
status = error
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.out.ref = out
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = info
"""


class KafkaStartError(RuntimeError):
    """A Kafka broker could not be started, or the cluster did not come up."""


@dataclass
class KafkaNode:
    node_id: int
    port: int
    controller_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "broker.log"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


@dataclass
class KafkaCluster:
    nodes: list[KafkaNode]
    jars: list[Path]
    jvm_options: tuple[str, ...]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(n.address for n in self.nodes)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The first broker's process (the only one of a one-broker cluster)."""
        process = self.nodes[0].process
        assert process is not None
        return process

    def kill(self, index: int) -> None:
        """SIGKILL broker ``index`` (a machine that goes away), and reap it."""
        node = self.nodes[index]
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()

    def restart(self, index: int, timeout: float = START_TIMEOUT_S) -> None:
        """Start broker ``index`` again, on its ports and its data, and wait until the cluster
        counts it again."""
        node = self.nodes[index]
        if node.process is not None and node.process.poll() is None:
            raise KafkaStartError(f"broker {node.node_id} is still running")
        node.process = _spawn(node, self.jars, self.jvm_options)
        self.wait_brokers(timeout)

    def alive(self) -> list[KafkaNode]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_brokers(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the cluster's metadata lists every running broker."""
        running = self.alive()
        expected = {n.node_id for n in running}

        def probe(timeout_s: float) -> str | None:
            closed = [n.node_id for n in running if not _listening(n.port)]
            if closed:  # no client until every broker listens: it would log each refusal
                return f"brokers {closed} not listening yet"
            try:
                seen = _brokers(",".join(n.address for n in running), timeout_s)
            except Exception as exc:  # confluent_kafka.KafkaException and friends
                return f"last error: {exc}"
            missing = expected - seen
            return None if not missing else f"brokers {sorted(missing)} not registered yet"

        def exited() -> str | None:
            for n in running:
                code = n.process.poll() if n.process is not None else 0
                if code is not None:
                    return f"Kafka broker {n.node_id} exited with code {code}"
            return None

        wait_ready(
            probe,
            exited,
            f"the Kafka cluster at {self.bootstrap_servers} did not list {len(running)} brokers",
            running[0].log_path if running else Path(os.devnull),
            timeout,
            KafkaStartError,
            max_delay=0.5,
        )


def broker_jars() -> list[Path]:
    """Apache Kafka's jars (fetched from Maven Central the first time)."""
    return fetch(KAFKA_BROKER, quiet=False)


@contextlib.contextmanager
def start_kafka(
    brokers: int = 1,
    *,
    flush_messages: int | None = None,
    settings: Mapping[str, str] | None = None,
    jvm_options: tuple[str, ...] = JVM_OPTIONS,
) -> Iterator[KafkaCluster]:
    """Run a ``brokers``-node KRaft cluster on loopback until the context exits."""
    if brokers < 1:
        raise ValueError("a Kafka cluster needs at least one broker")
    jars = broker_jars()
    root = Path(tempfile.mkdtemp(prefix="headwater-kafka-"))
    extra = dict(settings or {})
    if flush_messages is not None:
        extra["log.flush.interval.messages"] = str(flush_messages)
    cluster: KafkaCluster | None = None
    try:
        for attempt in range(1, _ATTEMPTS + 1):
            cluster = _layout(root / f"try-{attempt}", brokers, jars, jvm_options, extra)
            try:
                _start(cluster)
                break
            except KafkaStartError as e:
                # a port taken meanwhile, or a start that went wrong once: fresh ports and a
                # fresh folder (what went wrong is logged, and raised the last time)
                _stop(cluster)
                if attempt == _ATTEMPTS:
                    raise
                log.warning("Kafka did not start (attempt %d of %d): %s", attempt, _ATTEMPTS, e)
        assert cluster is not None
        yield cluster
    finally:
        if cluster is not None:
            _stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def _layout(
    root: Path,
    brokers: int,
    jars: list[Path],
    jvm_options: tuple[str, ...],
    extra: dict[str, str],
) -> KafkaCluster:
    ports = _distinct_ports(2 * brokers)
    nodes = [
        KafkaNode(i + 1, ports[2 * i], ports[2 * i + 1], root / f"node-{i + 1}")
        for i in range(brokers)
    ]
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in nodes)
    replicas = min(3, brokers)
    min_isr = 2 if brokers >= 3 else 1
    for node in nodes:
        node.directory.mkdir(parents=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{HOST}:{node.port},CONTROLLER://{HOST}:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.directory / "data"),
            "num.partitions": "1",
            "default.replication.factor": str(replicas),
            "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(replicas),
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": str(replicas),
            "transaction.state.log.min.isr": str(min_isr),
            "group.initial.rebalance.delay.ms": "0",
            "unclean.leader.election.enable": "false",
            # keep every record: tests append events stamped in the past, which Kafka's
            # time-based retention (7 days by default) would delete at its next check
            "log.retention.ms": "-1",
            **extra,
        }
        (node.directory / "server.properties").write_text(
            "".join(f"{k}={v}\n" for k, v in props.items())
        )
        (node.directory / "log4j2.properties").write_text(_LOG4J)
    return KafkaCluster(nodes, jars, jvm_options)


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(HOST)
        if port not in ports:
            ports.append(port)
    return ports


def _start(cluster: KafkaCluster) -> None:
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    formats = [_format(n, cluster.jars, cluster_id) for n in cluster.nodes]
    deadline = time.monotonic() + _FORMAT_TIMEOUT_S
    try:
        for node, process in zip(cluster.nodes, formats, strict=True):
            try:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -9
            if code != 0:
                raise KafkaStartError(
                    f"formatting the storage of Kafka broker {node.node_id} failed "
                    f"(exit {code}):\n{tail(node.directory / 'format.log')}"
                )
    finally:  # one format failed or hung: the others are not left running
        for process in formats:
            stop_process(process, STOP_TIMEOUT_S, terminate_first=False)
    for node in cluster.nodes:
        node.process = _spawn(node, cluster.jars, cluster.jvm_options)
    cluster.wait_brokers()


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaStartError("no java found (JAVA_HOME or PATH): run scripts/bootstrap.sh")
    return found


def _java_command(node: KafkaNode, jars: list[Path], options: tuple[str, ...]) -> list[str]:
    return [
        _java(),
        *options,
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={node.directory / 'log4j2.properties'}",
        "-cp",
        classpath(jars),
    ]


def _format(node: KafkaNode, jars: list[Path], cluster_id: str) -> subprocess.Popen[bytes]:
    command = [
        *_java_command(node, jars, ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")),
        "kafka.tools.StorageTool",
        "format",
        f"--cluster-id={cluster_id}",  # one argument: an id may start with "-"
        "-c",
        str(node.directory / "server.properties"),
    ]
    with (node.directory / "format.log").open("wb") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _spawn(node: KafkaNode, jars: list[Path], options: tuple[str, ...]) -> subprocess.Popen[bytes]:
    command = [
        *_java_command(node, jars, options),
        "kafka.Kafka",
        str(node.directory / "server.properties"),
    ]
    with node.log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=node.directory,
            start_new_session=True,
        )


def _stop(cluster: KafkaCluster) -> None:
    # SIGKILL: the data is throwaway, and a broker's controlled shutdown waits on the others
    for node in cluster.nodes:
        if node.process is not None:
            stop_process(node.process, STOP_TIMEOUT_S, terminate_first=False)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def _brokers(bootstrap: str, timeout: float) -> set[int]:
    """The broker ids the cluster's metadata lists now."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(
        {"bootstrap.servers": bootstrap, "socket.timeout.ms": max(100, int(timeout * 1000))}
    )
    metadata = admin.list_topics(timeout=timeout)
    return set(metadata.brokers)
