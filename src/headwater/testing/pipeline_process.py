"""``headwater pipeline`` as a child process of its own session, for fault tests: SIGKILL takes
the whole process group (Python and its Spark JVM), as a power cut would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def start_pipeline(config_file: Path, log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """``headwater --config F pipeline ARGS``; its output appended to ``log_path``."""
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "headwater", "--config", str(config_file)]
    with log_path.open("ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [*command, "pipeline", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop(child: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """SIGKILL: the whole process group, as a power cut would; SIGTERM: headwater's process
    (it stops Spark itself), then whatever is left of the group."""
    if sig == signal.SIGTERM and child.poll() is None:
        child.send_signal(sig)
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not stop the pipeline within 120 s") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait(60)
