"""``headwater console`` over HTTPS (``console.tls``): health, a login whose cookie is marked
Secure, the pages; SIGHUP presents a renewed certificate to new connections while the logged-in
session goes on; a key that does not match is refused at start, naming the files."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import requests
import yaml
from click.testing import CliRunner
from tests.collector.test_tls import HOST, Pki, served_serial
from tests.console.conftest import TOKEN

from headwater.cli.main import cli
from headwater.collector.auth import hash_key
from headwater.testing.collector import CollectorProcess
from headwater.testing.tls import CertificateAuthority, self_signed
from headwater.testing.waiting import wait_until

TIMEOUT_S = 30.0


def write_config(tmp_path: Path, cert_file: Path, key_file: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    console = {
        "admin_token_hashes": [hash_key(TOKEN)],
        "port": 0,
        "tls": {"cert_file": str(cert_file), "key_file": str(key_file)},
    }
    path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "console": console}))
    return path


def test_the_console_serves_https_and_reloads_its_certificate_on_sighup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = Pki(CertificateAuthority(), tmp_path)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(pki.ca_file))
    config = write_config(tmp_path, pki.config.cert_file, pki.config.key_file)
    process = CollectorProcess(config, tmp_path / "console.err", ("console", "--port", "0"))
    try:
        line = process.wait_for_line("headwater: console at ")
        url = line.split(" at ", 1)[1].split("/ ", 1)[0].rstrip("/")
        assert url.startswith(f"https://{HOST}:")
        process.wait_for_line("headwater: console ready")
        port = int(url.rsplit(":", 1)[1])
        assert requests.get(f"{url}/healthz", timeout=TIMEOUT_S).text == "ok"

        session = requests.Session()
        session.headers["Origin"] = url
        login = session.post(
            f"{url}/login", data={"token": TOKEN}, allow_redirects=False, timeout=TIMEOUT_S
        )
        assert login.status_code == 303
        assert "secure" in login.headers["Set-Cookie"].lower().split("; ")
        page = session.get(f"{url}/", headers={"Accept": "text/html"}, timeout=TIMEOUT_S)
        assert page.status_code == 200

        old = served_serial(port, pki.client())
        new = pki.renew()
        os.kill(process.proc.pid, signal.SIGHUP)
        wait_until(lambda: served_serial(port, pki.client()) == new, "the renewed certificate")
        assert old != new
        again = session.get(f"{url}/", headers={"Accept": "text/html"}, timeout=TIMEOUT_S)
        assert again.status_code == 200  # still logged in, the console still serving
        assert process.stop() == 0
        assert "TLS certificate reloaded" in process.stderr()
    finally:
        process.close()


def test_the_console_refuses_to_start_with_a_key_that_does_not_match(tmp_path: Path) -> None:
    pki = Pki(CertificateAuthority(), tmp_path)
    _, other_key = self_signed(HOST).write(tmp_path, "other")
    config = write_config(tmp_path, pki.config.cert_file, other_key)
    done = CliRunner().invoke(
        cli, ["--config", str(config), "console", "--port", "0"], env={"HEADWATER_CONFIG": None}
    )
    assert done.exit_code == 1
    assert (
        f"error: HW-CFG-020: console.tls: the key in {other_key} does not match the certificate "
        f"in {pki.config.cert_file}"
    ) in done.output
