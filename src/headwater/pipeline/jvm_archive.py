"""Making the driver JVM's class-data sharing archive (``headwater.pipeline.driver_jvm``) once per
machine: ``python -m headwater.pipeline.jvm_archive``, which ``scripts/bootstrap.sh`` runs. The
archive is what a throwaway pipeline run loads, written by the JVM of a child process at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from headwater.pipeline.driver_jvm import ARCHIVE_ENV, archive_path


def ensure_archive(jars: str = "") -> Path | None:
    """Make the archive unless it exists: a throwaway pipeline run (a few events through the
    embedded log into DuckDB, in a temporary folder) in a child process whose JVM writes the
    classes it loaded when it exits. Returns the archive's path (None when no JVM is found)."""
    archive = archive_path(jars)
    if archive is None or archive.exists():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="headwater-jvm-") as tmp:
        partial = Path(tmp) / "spark.jsa"
        env = {**os.environ, ARCHIVE_ENV: str(partial), "SPARK_LOCAL_IP": "127.0.0.1"}
        command = [sys.executable, "-m", "headwater.pipeline.jvm_archive", "--run", tmp]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not partial.exists():
            raise RuntimeError(
                f"could not make the JVM archive (exit {done.returncode}): {done.stderr[-2000:]}"
            )
        os.replace(partial, archive)  # complete or not there: never half written
    return archive


def _exercise(folder: Path) -> None:
    """Load the classes a pipeline run loads: a session, the source, the sink, a commit."""
    from headwater.bus import Message, open_bus
    from headwater.config.model import HeadwaterConfig
    from headwater.pipeline.runner import Pipeline
    from headwater.pipeline.spark import spark_session

    config = HeadwaterConfig.model_validate(
        {
            "data_dir": str(folder / "data"),
            "bus": {"embedded": {"durability": "never"}},
            "pipeline": {"destinations": [{"id": "warehouse", "type": "duckdb"}]},
        }
    )
    with open_bus(config) as bus:
        bus.create_topic("events-jvm", 1)
        headers = (("content-type", b"application/json"), ("type", b"jvm"))
        bus.append("events-jvm", [Message(b'{"n": 1}', headers=headers)] * 10).result()
        bus.flush()
    spark = spark_session(config.pipeline.spark)
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()
    spark.stop()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--run"]:
        _exercise(Path(argv[1]))
        return 0
    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import extra_jars

    path = archive_path(extra_jars(SparkConfig()))
    if path is not None and path.exists():
        return 0
    if "--quiet" in argv:
        print("bootstrap: making the JVM class archive (once; about 30 s)", file=sys.stderr)
    path = ensure_archive(extra_jars(SparkConfig()))
    if "--quiet" not in argv:
        print(f"headwater: JVM class archive: {path or 'no java found'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
