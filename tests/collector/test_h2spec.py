"""h2spec, the HTTP/2 conformance suite (RFC 9113 and RFC 7541, with its strict cases), against
the gRPC port of a real ``headwater collector``, over plain h2c and over TLS.

``scripts/bootstrap.sh`` builds h2spec 2.2.1 into ``~/.cache/headwater/go``. Every case must
pass: none is skipped here. h2spec's requests are GETs to the collector's one gRPC path without
a gRPC content-type; the collector answers them as an HTTP server answers a request it cannot
serve (415 with a text body, once the request is whole), which is what the cases that need a
response body read.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from headwater.collector.protocols import raccoon
from headwater.testing.collector import collector_with_grpc
from headwater.testing.tls import CertificateAuthority

H2SPEC = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headwater/go/bin/h2spec"
CASES = 146  # h2spec 2.2.1 with --strict: generic, RFC 7540 (now 9113) and HPACK cases


@pytest.fixture(scope="module")
def grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with collector_with_grpc(tmp_path_factory.mktemp("h2spec")) as (_, port):
        yield port


@pytest.fixture(scope="module")
def tls_grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("h2spec-tls")
    authority = CertificateAuthority()
    cert, key = authority.issue("127.0.0.1", "localhost").write(root, "server")
    tls = f"  tls:\n    cert_file: {cert}\n    key_file: {key}"
    with collector_with_grpc(root, tls, authority.client_context()) as (_, port):
        yield port


def run_h2spec(port: int, report: Path, *flags: str) -> list[str]:
    """Run every h2spec case against ``port``; returns the names of the cases that did not pass
    (failed, errored or skipped), each with h2spec's reason."""
    assert H2SPEC.exists(), f"{H2SPEC} is missing: scripts/bootstrap.sh builds it"
    target = ["-h", "127.0.0.1", "-p", str(port), "-P", raccoon.METHOD]
    done = subprocess.run(
        [str(H2SPEC), *target, "--strict", "-o", "5", "-j", str(report), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    not_passed, count = [], 0
    for case in cases:
        count += 1
        for outcome in ("failure", "error", "skipped"):
            found = case.find(outcome)
            if found is not None:
                name = f"{case.get('package')} {case.get('classname')}"
                reason = (found.get("message") or "") + " " + (found.text or "")
                not_passed.append(f"{name}: {outcome} {reason}")
    assert count == CASES, f"h2spec ran {count} cases, not {CASES}: {done.stdout[-2000:]}"
    return not_passed


def test_h2spec_passes_every_case_over_h2c(grpc_port: int, tmp_path: Path) -> None:
    not_passed = run_h2spec(grpc_port, tmp_path / "h2c.xml")
    assert not not_passed, "\n".join(not_passed)


def test_h2spec_passes_every_case_over_tls(tls_grpc_port: int, tmp_path: Path) -> None:
    """Over TLS (``-t -k``: the certificate is the test's own) h2spec adds its TLS cases
    (RFC 9113 §9.2: TLS 1.2 or later, no compression or renegotiation, no blocked suites)."""
    not_passed = run_h2spec(tls_grpc_port, tmp_path / "tls.xml", "-t", "-k")
    assert not not_passed, "\n".join(not_passed)
