"""Starting the driver's JVM fast in local mode: a class-data sharing archive and the C1 compiler.

A cold ``SparkSession`` took 6.2 s here to start, most of it loading and verifying Spark's
classes, and its first job another 2.9 s; with a CDS archive of those classes (made once on this
machine from the installed JVM and jars: ``python -m headwater.pipeline.jvm``, which
``scripts/bootstrap.sh`` runs) and the C1 compiler only, 2.3 s and 0.9 s. In local mode the
driver's JVM only plans and schedules (no event passes through it: the sink's tasks read the log
and stage rows in Python), so the optimizing compiler has nothing to earn there.

The archive is named by what it depends on (the JVM, PySpark's version, the extra jars); a JVM
that cannot use it (anything changed) starts without it, silently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The heap of a JVM that only plans and schedules: the serial collector (G1's own structures
# took ~50 MB) and a heap that starts small and grows as needed (the default first heap is 1/64 of
# the machine's memory, and G1 kept what it had: the JVM held 430-550 MB, now ~350)
HEAP_OPTIONS = ("-XX:+UseSerialGC", "-Xms64m")
ARCHIVE_ENV = "HEADWATER_JVM_ARCHIVE"  # set: the JVM writes its loaded classes there at exit
CACHE_ENV = "HEADWATER_CACHE"


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "headwater"


def java_binary() -> Path | None:
    """The ``java`` PySpark's launcher starts: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = Path(home) / "bin" / "java" if home else None
    if found is None or not found.exists():
        on_path = shutil.which("java")
        found = Path(on_path) if on_path else None
    return found.resolve() if found is not None else None


def archive_path(jars: str = "") -> Path | None:
    """Where the archive for this JVM, PySpark and extra ``jars`` is (None: no JVM found)."""
    import pyspark

    java = java_binary()
    if java is None:
        return None
    release = java.parent.parent / "release"
    stamp = release.read_text() if release.exists() else str(java.stat().st_mtime)
    # the jars' folder too: an archive made for another install's classpath is never used
    key = "\n".join(
        [str(java), stamp, pyspark.__version__, str(Path(pyspark.__file__).parent), jars]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "jvm" / f"spark-{digest}.jsa"


def driver_options(jars: str = "", *, heavy: bool = False) -> list[str]:
    """JVM options for a local-mode driver: C1 only (unless ``heavy``: the JVM itself moves
    the records, as Spark's Kafka connector does, and C2's code pays off), and the archive when
    there is one (or, with ``HEADWATER_JVM_ARCHIVE`` set, write one there at exit)."""
    options = [*([] if heavy else ["-XX:TieredStopAtLevel=1"]), *HEAP_OPTIONS]
    making = os.environ.get(ARCHIVE_ENV)
    if making:
        return [*options, f"-XX:ArchiveClassesAtExit={making}"]
    archive = archive_path(jars)
    if archive is not None and archive.exists():
        options += [f"-XX:SharedArchiveFile={archive}", "-Xshare:auto", "-Xlog:cds*=off"]
    return options


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
        command = [sys.executable, "-m", "headwater.pipeline.jvm", "--run", tmp]
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
