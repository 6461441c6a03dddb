"""headwater.jvm.maven: JVM artifacts are fetched once into the cache, a half-done or outdated fetch
is never used, and a machine without mvn gets an error that says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater.jvm import maven
from headwater.jvm.maven import Artifact, ArtifactError, cached, fetch, unversioned

TINY = Artifact("a test artifact", "org.example", "tiny", "1.0")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HEADWATER_CACHE", str(tmp_path))
    return tmp_path / "headwater" / "maven"


def complete(artifact: Artifact, stamp: str | None = None) -> Path:
    jars = artifact.folder / "jars"
    jars.mkdir(parents=True, exist_ok=True)
    (jars / "tiny-1.0.jar").write_bytes(b"PK")
    (artifact.folder / maven.STAMP).write_text(stamp if stamp is not None else maven._pom(artifact))
    return jars / "tiny-1.0.jar"


def test_a_complete_fetch_is_used_without_mvn(monkeypatch: pytest.MonkeyPatch) -> None:
    jar = complete(TINY)
    monkeypatch.setattr(maven.shutil, "which", lambda _: None)
    assert fetch(TINY) == [jar]


def test_a_fetch_without_its_stamp_or_for_another_definition_is_not_used() -> None:
    (TINY.folder / "jars").mkdir(parents=True)  # interrupted: jars, no stamp
    assert cached(TINY) is None
    other = Artifact("a test artifact", "org.example", "tiny", "1.0", also=("org.example:x:2",))
    complete(other, stamp=maven._pom(TINY))  # fetched before "also" was added
    assert cached(other) is None


def test_no_mvn_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(maven.shutil, "which", lambda _: None)
    with pytest.raises(ArtifactError, match=r"mvn.*is not installed") as caught:
        fetch(TINY)
    assert "org.example:tiny:1.0" in str(caught.value)
    assert caught.value.code == "HW-DEP-002"


def test_the_pom_names_the_artifact_and_what_comes_with_it() -> None:
    pom = maven._pom(Artifact("x", "org.a", "b<c", "1", also=("org.d:e:2",)))
    assert "<artifactId>b&lt;c</artifactId>" in pom
    assert "<groupId>org.d</groupId><artifactId>e</artifactId><version>2</version>" in pom


@pytest.mark.parametrize(
    ("name", "artifact"),
    [
        ("kafka-clients-3.9.2.jar", "kafka-clients"),
        ("spark-sql-kafka-0-10_2.13-4.2.0.jar", "spark-sql-kafka-0-10_2.13"),
        ("zstd-jni-1.5.6-10.jar", "zstd-jni"),
        ("commons-pool2-2.13.1.jar", "commons-pool2"),
    ],
)
def test_unversioned(name: str, artifact: str) -> None:
    assert unversioned(Path(name)) == artifact


def test_a_jar_for_sparks_class_path_comes_without_what_pyspark_ships() -> None:
    """delta-spark's kernel brings older Hadoop and Scala jars: excluded by artifact name, as
    PySpark's own copies are found first (or clash)."""
    shipped = {unversioned(j) for j in maven.pyspark_jars()}
    assert {"hadoop-client-api", "scala-library"} <= shipped
    pom = maven._pom(Artifact("x", "org.a", "b", "1", beside_pyspark=True))
    for name in ("hadoop-client-api", "scala-library"):
        assert f"<groupId>*</groupId><artifactId>{name}</artifactId>" in pom
    assert "<exclusion>" not in maven._pom(Artifact("x", "org.a", "b", "1"))
