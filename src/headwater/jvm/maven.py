"""JVM artifacts from Maven Central, fetched once with ``mvn`` into a cache outside the repo.

headwater needs jars that PySpark does not ship: Apache Kafka's broker (tests and benchmarks start
it in KRaft mode), Spark's Kafka connector (``headwater pipeline`` with ``bus: kafka``), Delta
Lake for Spark (Spark reading and writing the tables of a ``type: delta`` destination) and
Hadoop's S3A filesystem (Spark on ``s3a://`` paths). Each :class:`Artifact` is fetched, with its
runtime dependencies, by ``mvn dependency:copy-dependencies`` on a small pom written for it, into
``<cache>/maven/<name>-<version>/`` (``<cache>``: ``$HEADWATER_CACHE/headwater``, else
``$XDG_CACHE_HOME/headwater``, else ``~/.cache/headwater``). A folder is complete once its stamp
file holds the pom it was fetched with, so an interrupted fetch, or one for an older definition,
is started again, never used half done; a lock keeps two processes from fetching the same
artifact at once. Nothing fetched is part of the repository.

An artifact for Spark's class path (``beside_pyspark``) is fetched without any dependency that
PySpark ships a jar of, whatever its version (the pom excludes them by artifact name, so the
stamp changes when PySpark's jars do): Spark finds its own copy first, so a second one, often
older (delta-spark's kernel brings hadoop-client-runtime 3.4.2 and Scala 2.13.17), is dead
weight at best and a clash under a child-first class loader.

    jars = fetch(KAFKA_BROKER)          # list of jar paths; fetched on first use
    python -m headwater.jvm.maven broker connector delta s3a   # what scripts/bootstrap.sh runs
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from headwater.errors import TerminalError
from headwater.jvm.cache import cache_dir

KAFKA_VERSION = "4.1.1"  # the broker tests and benchmarks run
DELTA_VERSION = "4.4.0"  # Delta Lake for Spark, built for Spark 4.2 (delta-spark_4.2_2.13)
STAMP = ".complete"
FETCH_TIMEOUT_S = 900.0


class ArtifactError(TerminalError):
    """A JVM artifact could not be fetched (no mvn, Maven Central unreachable, not served)."""

    code = "HW-DEP-002"


@dataclass(frozen=True)
class Artifact:
    """``group:artifact:version``, fetched with its runtime dependencies and ``also``."""

    label: str  # for messages: "Apache Kafka's broker"
    group: str
    artifact: str
    version: str
    also: tuple[str, ...] = ()  # more group:artifact:version fetched with it
    beside_pyspark: bool = False  # for Spark's class path: no dependency PySpark ships a jar of

    @property
    def coordinates(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    @property
    def folder(self) -> Path:
        return cache_dir() / "maven" / f"{self.artifact}-{self.version}"


# the broker logs through SLF4J: the binding to the log4j2 it ships (as Kafka's own tarball does)
KAFKA_BROKER = Artifact(
    "Apache Kafka's broker",
    "org.apache.kafka",
    "kafka_2.13",
    KAFKA_VERSION,
    also=("org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",),
)


def spark_kafka_connector(spark_version: str | None = None) -> Artifact:
    """Spark's Kafka source at the installed PySpark's version (Spark's own jars, which the
    connector's pom marks ``provided``, are not fetched)."""
    if spark_version is None:
        import pyspark

        spark_version = pyspark.__version__
    return Artifact(
        "Spark's Kafka connector",
        "org.apache.spark",
        "spark-sql-kafka-0-10_2.13",
        spark_version,
    )


# Spark's own jars (its Scala, Hadoop client, Parquet, Jackson) are "provided" in delta-spark's
# pom, yet its kernel modules bring older copies of them (hadoop-client-runtime 3.4, Scala 2.13.17)
DELTA_SPARK = Artifact(
    "Delta Lake for Spark", "io.delta", "delta-spark_4.2_2.13", DELTA_VERSION, beside_pyspark=True
)


def hadoop_aws(hadoop_version: str | None = None) -> Artifact:
    """Hadoop's S3A filesystem at the version of the Hadoop client PySpark ships, with the AWS
    SDK v2 bundle it needs (Hadoop's own jars, ``provided`` in its pom, are not fetched)."""
    if hadoop_version is None:
        hadoop_version = _shipped_version("hadoop-client-api")
    return Artifact(
        "Hadoop's S3A filesystem",
        "org.apache.hadoop",
        "hadoop-aws",
        hadoop_version,
        beside_pyspark=True,
    )


def pyspark_jars() -> list[Path]:
    """The jars the installed PySpark ships (its Spark home's ``jars``)."""
    from pyspark.find_spark_home import _find_spark_home

    return sorted((Path(_find_spark_home()) / "jars").glob("*.jar"))


def _shipped_version(name: str) -> str:
    versions = [j.stem[len(name) + 1 :] for j in pyspark_jars() if unversioned(j) == name]
    if not versions:
        raise ArtifactError(f"PySpark ships no {name} jar to take the version from")
    return versions[0]


def cached(artifact: Artifact) -> list[Path] | None:
    """The artifact's jars if they were fetched completely, else None."""
    stamp = artifact.folder / STAMP
    if not stamp.exists() or stamp.read_text() != _pom(artifact):
        return None
    return sorted((artifact.folder / "jars").glob("*.jar"))


def fetch(artifact: Artifact, *, quiet: bool = True) -> list[Path]:
    """The artifact's jars with their runtime dependencies, fetched unless already cached."""
    jars = cached(artifact)
    if jars is not None:
        return jars
    with _locked(artifact.folder):
        jars = cached(artifact)  # another process fetched it while we waited for the lock
        if jars is not None:
            return jars
        _download(artifact, quiet=quiet)
    jars = cached(artifact)
    assert jars is not None
    return jars


def classpath(jars: list[Path]) -> str:
    return ":".join(str(j) for j in jars)


def unversioned(jar: Path) -> str:
    """A jar's artifact name without its version: ``kafka-clients`` of kafka-clients-3.9.2.jar."""
    return re.sub(r"-\d+\.[\w.-]*$", "", jar.name.removesuffix(".jar"))


def _dependency(coordinates: str, exclusions: str) -> str:
    group, name, version = coordinates.split(":")
    return (
        f"<dependency><groupId>{escape(group)}</groupId>"
        f"<artifactId>{escape(name)}</artifactId><version>{escape(version)}</version>"
        f"{exclusions}</dependency>"
    )


def _exclusions(artifact: Artifact) -> str:
    """For ``beside_pyspark``: every artifact PySpark has a jar of, in any group (a jar's name
    does not tell its group), with what it depends on."""
    if not artifact.beside_pyspark:
        return ""
    names = sorted({unversioned(j) for j in pyspark_jars()})
    excluded = "".join(
        f"<exclusion><groupId>*</groupId><artifactId>{escape(n)}</artifactId></exclusion>"
        for n in names
    )
    return f"<exclusions>{excluded}</exclusions>"


def _pom(artifact: Artifact) -> str:
    exclusions = _exclusions(artifact)
    dependencies = "".join(
        _dependency(c, exclusions) for c in (artifact.coordinates, *artifact.also)
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<project xmlns="http://maven.apache.org/POM/4.0.0">'
        "<modelVersion>4.0.0</modelVersion>"
        "<groupId>dev.headwater.fetch</groupId><artifactId>fetch</artifactId>"
        "<version>1</version><packaging>pom</packaging>"
        f"<dependencies>{dependencies}</dependencies></project>\n"
    )


def _download(artifact: Artifact, *, quiet: bool) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ArtifactError(
            f"{artifact.label} ({artifact.coordinates}) is not in {artifact.folder} and `mvn` "
            "is not installed to fetch it from Maven Central: install Maven "
            "(apt-get install maven) or run scripts/bootstrap.sh"
        )
    folder = artifact.folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            f"headwater: fetching {artifact.label} ({artifact.coordinates}) from Maven Central",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix=f"{artifact.artifact}-", dir=folder.parent) as tmp:
        work = Path(tmp)
        (work / "pom.xml").write_text(_pom(artifact))
        command = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={work / 'jars'}",
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise ArtifactError(
                f"fetching {artifact.coordinates} took more than {FETCH_TIMEOUT_S:.0f} s"
            ) from None
        if done.returncode != 0 or not any((work / "jars").glob("*.jar")):
            output = (done.stdout + done.stderr)[-3000:]
            raise ArtifactError(
                f"could not fetch {artifact.label} ({artifact.coordinates}) with mvn "
                f"(exit {done.returncode}); is Maven Central reachable and the version served?"
                f"\n{output}"
            )
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted fetch left
        folder.mkdir()
        (work / "jars").rename(folder / "jars")
        (work / "pom.xml").rename(folder / "pom.xml")
        (folder / STAMP).write_text(_pom(artifact))


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


NAMED = {
    "broker": lambda: KAFKA_BROKER,
    "connector": lambda: spark_kafka_connector(),
    "delta": lambda: DELTA_SPARK,
    "s3a": lambda: hadoop_aws(),
}


def main(argv: list[str]) -> int:
    """Fetch the named artifacts (``broker``, ``connector``, ``delta``, ``s3a``); print their
    folders."""
    names = [a for a in argv if not a.startswith("-")] or list(NAMED)
    unknown = [n for n in names if n not in NAMED]
    if unknown:
        print(f"unknown artifact {', '.join(unknown)}; known: {', '.join(NAMED)}", file=sys.stderr)
        return 2
    for name in names:
        artifact = NAMED[name]()
        try:
            jars = fetch(artifact, quiet="--quiet" in argv)
        except ArtifactError as e:
            print(f"headwater: {e}", file=sys.stderr)
            return 1
        if "--quiet" not in argv:
            print(f"{artifact.coordinates}: {len(jars)} jars in {artifact.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
