"""Start a throwaway Spark standalone cluster on loopback for tests: one master and its workers,
from the pip-installed PySpark's own ``bin/spark-class``.

    with start_spark_cluster(workers=2) as cluster:
        spark_session(SparkConfig(master=cluster.url))
        os.kill(cluster.workers[0].pid, signal.SIGKILL)  # a worker's machine goes away

Each worker offers one core and 1 GiB to executors. The context waits until the master counts
every worker alive, and stops them all (workers first) when it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from headwater.testing._service import ProcessSpec, run_process, wait_ready
from headwater.testing.ports import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


class SparkClusterError(RuntimeError):
    """The standalone master or a worker did not come up."""


@dataclass(frozen=True)
class SparkCluster:
    url: str  # spark://127.0.0.1:<port>, the master URL drivers use
    ui_url: str  # the master's web UI (its /json/ tells the workers' state)
    master_pid: int
    workers: list[subprocess.Popen[bytes]]

    def alive_workers(self) -> int:
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as response:
            return int(json.load(response)["aliveworkers"])


def spark_class() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home()) / "bin" / "spark-class"


def _env(directory: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_LOCAL_IP": HOST,
        "SPARK_LOG_DIR": str(directory),
        "SPARK_WORKER_DIR": str(directory / "work"),
        "SPARK_NO_DAEMONIZE": "1",
    }


def _spec(name: str, answers: str) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        answers=answers,
        error_cls=SparkClusterError,
        host=HOST,
        port_taken=("Address already in use", "BindException"),
        temp_prefix=f"headwater-{name}-",
        log_name=f"{name}.log",
        start_timeout=START_TIMEOUT_S,
        stop_timeout=STOP_TIMEOUT_S,
    )


def _listening(port: int, timeout: float) -> None:
    with socket.create_connection((HOST, port), timeout=timeout):
        pass


@contextlib.contextmanager
def _master() -> Iterator[tuple[int, int, int]]:
    ui_port = free_port(HOST)

    def spawn(port: int, directory: Path, log_path: Path) -> subprocess.Popen[bytes]:
        command = [str(spark_class()), _MASTER_CLASS, "--host", HOST, "--port", str(port)]
        with log_path.open("ab") as log:
            return subprocess.Popen(
                [*command, "--webui-port", str(ui_port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(directory),
                start_new_session=True,
            )

    with run_process(_spec("spark-master", "RPC connections"), spawn, _listening) as running:
        yield running.port, ui_port, running.process.pid


@contextlib.contextmanager
def _worker(master_url: str) -> Iterator[subprocess.Popen[bytes]]:
    def spawn(port: int, directory: Path, log_path: Path) -> subprocess.Popen[bytes]:
        command = [str(spark_class()), _WORKER_CLASS, "--host", HOST, "--port", str(port)]
        options = ["--cores", "1", "--memory", "1g", "--webui-port", "0"]
        with log_path.open("ab") as log:
            return subprocess.Popen(
                [*command, *options, "--work-dir", str(directory / "work"), master_url],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(directory),
                start_new_session=True,
            )

    with run_process(_spec("spark-worker", "RPC connections"), spawn, _listening) as running:
        yield running.process


@contextlib.contextmanager
def start_spark_cluster(workers: int = 2) -> Iterator[SparkCluster]:
    """A standalone master and ``workers`` workers on loopback until the context exits."""
    with _master() as (port, ui_port, pid), contextlib.ExitStack() as stack:
        url = f"spark://{HOST}:{port}"
        started = [stack.enter_context(_worker(url)) for _ in range(workers)]
        cluster = SparkCluster(url, f"http://{HOST}:{ui_port}", pid, started)

        def probe(_timeout: float) -> str | None:
            try:
                alive = cluster.alive_workers()
            except OSError as exc:
                return f"last error: {exc}"
            return None if alive >= workers else f"{alive} of {workers} workers alive"

        wait_ready(
            probe,
            lambda: None,
            f"the Spark master at {url} did not count {workers} workers",
            Path(os.devnull),
            START_TIMEOUT_S,
            SparkClusterError,
        )
        yield cluster
