"""``headwater console`` as a process of its own: it serves beside a log another process holds
(read-only), answers /healthz, refuses requests without a session, and stops on SIGTERM; without
an admin token it does not start."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import requests
import yaml
from click.testing import CliRunner
from tests.console.conftest import TOKEN
from tests.roles.test_up import clean_env

from headwater.bus import Message
from headwater.cli.main import cli
from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.testing.process import OutputLines

DEADLINE_S = 30.0


def write_config(tmp_path: Path, tokens: list[str]) -> Path:
    path = tmp_path / "headwater.yaml"
    document = {
        "data_dir": str(tmp_path / "data"),
        "console": {"admin_token_hashes": tokens, "port": 0},
    }
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_console_role_serves_beside_the_log_writer_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    from headwater.bus import open_bus

    path = write_config(tmp_path, [hash_key(TOKEN)])
    config = load_config(path)
    config.data_dir.mkdir(parents=True)
    with open_bus(config) as writer:  # this process holds the log, as `headwater up` would
        writer.create_topic("events-track", 1)
        writer.append("events-track", [Message(b'{"n": 1}')]).result()
        cmd = [sys.executable, "-m", "headwater.cli.main", "--config", str(path)]
        proc = subprocess.Popen(
            [*cmd, "console", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        assert proc.stdout is not None and proc.stderr is not None
        out = OutputLines(proc.stdout, "headwater console", lambda: "")
        try:
            line = out.wait_for("headwater: console at ", DEADLINE_S)
            url = line.split(" at ", 1)[1].split("/ ", 1)[0].rstrip("/")
            out.wait_for("headwater: console ready", DEADLINE_S)
            assert requests.get(f"{url}/healthz", timeout=DEADLINE_S).text == "ok"
            assert requests.get(f"{url}/", timeout=DEADLINE_S).status_code == 401
            session = requests.Session()
            session.headers["Origin"] = url
            session.post(f"{url}/login", data={"token": TOKEN}, timeout=DEADLINE_S)
            page = session.get(f"{url}/", headers={"Accept": "text/html"}, timeout=DEADLINE_S)
            assert page.status_code == 200 and ">events-track</a>" in page.text
            writer.append("events-track", [Message(b'{"n": 2}')]).result()
            record = session.get(
                f"{url}/live/record?topic=events-track&partition=0&offset=1", timeout=DEADLINE_S
            )
            assert record.json()["value"] == '{"n": 2}'  # what the writer appended since
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=DEADLINE_S) == 0
            out.wait_for("headwater: stopped", DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=DEADLINE_S)
            proc.stdout.close()
            proc.stderr.close()


def test_without_an_admin_token_the_console_does_not_start(tmp_path: Path) -> None:
    path = write_config(tmp_path, [])
    result = CliRunner().invoke(cli, ["--config", str(path), "console", "--port", "0"])
    assert result.exit_code == 1
    assert "console.admin_token_hashes is empty" in result.output
    assert "headwater hash-key" in result.output
