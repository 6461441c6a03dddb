"""Starting the driver's JVM fast in local mode: a class-data sharing archive and the C1 compiler.

A cold ``SparkSession`` took 6.2 s here to start, most of it loading and verifying Spark's
classes, and its first job another 2.9 s; with a CDS archive of those classes (made once on this
machine from the installed JVM and jars: ``python -m headwater.pipeline.jvm_archive``, which
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
from pathlib import Path

from headwater.jvm.cache import cache_dir

# The heap of a JVM that only plans and schedules: the serial collector (G1's own structures
# took ~50 MB) and a heap that starts small and grows as needed (the default first heap is 1/64 of
# the machine's memory, and G1 kept what it had: the JVM held 430-550 MB, now ~350)
HEAP_OPTIONS = ("-XX:+UseSerialGC", "-Xms64m")
ARCHIVE_ENV = "HEADWATER_JVM_ARCHIVE"  # set: the JVM writes its loaded classes there at exit


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
