"""``headwater up``: a real process that serves /healthz and stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headwater.cli.main import cli
from headwater.testing.process import OutputLines

DEADLINE_S = 30.0


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text("data_dir: state\nbus:\n  embedded:\n    durability: always\n")
    return path


def up_command(config_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "headwater.cli.main", "--config", str(config_file)]
    return [*cmd, "up", "--port", "0", "--grpc-port", "0"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}


def cli_run(config_file: Path, *args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        cli, ["--config", str(config_file), *args], input=input, env={"HEADWATER_CONFIG": None}
    )
    return result.exit_code, result.stdout, result.stderr


class UpProcess:
    """``headwater up --port 0`` in a child process, with its stdout read line by line."""

    def __init__(self, config_file: Path) -> None:
        self.proc = subprocess.Popen(
            up_command(config_file),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        assert self.proc.stdout is not None
        self.out = OutputLines(self.proc.stdout, "headwater up", self.stderr)

    def wait_for_line(self, prefix: str) -> str:
        """The first stdout line starting with ``prefix``; fails at the deadline or at exit."""
        return self.out.wait_for(prefix, DEADLINE_S)

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()

    def stop(self, sig: signal.Signals) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=DEADLINE_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE_S)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def up_process(config_file: Path) -> Iterator[UpProcess]:
    up = UpProcess(config_file)
    try:
        yield up
    finally:
        up.kill()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=DEADLINE_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def test_up_serves_health_and_stops_cleanly_on_sigterm(config_file: Path) -> None:
    lines = "".join(json.dumps({"id": f"u{i}", "n": i}) + "\n" for i in range(5))
    code, _out, err = cli_run(config_file, "log", "append", "events", "-k", "id", input=lines)
    assert code == 0, err

    up = UpProcess(config_file)
    try:
        log_line = up.wait_for_line("headwater: bus open: ")
        url = up.wait_for_line("headwater: health at ").split(" at ", 1)[1]
        assert str(config_file.parent / "state" / "log") in log_line
        up.wait_for_line("headwater: ready")

        assert get(url) == (200, "ok\n")
        assert get(url.replace("/healthz", "/nope"))[0] == 404

        # While the server holds the write lock, reading works and writing is refused.
        code, out, err = cli_run(config_file, "log", "view", "events", "--format", "json")
        assert code == 0, err
        assert len(out.splitlines()) == 5
        code, _out, err = cli_run(config_file, "log", "append", "events", input=lines)
        assert code == 1
        assert err.startswith("error: HW-BUS-007: ")

        assert up.stop(signal.SIGTERM) == 0
        up.wait_for_line("headwater: stopped")
        assert "Traceback" not in up.stderr()
    finally:
        up.kill()

    # The data appended before is still there, and the log is free for writers again.
    code, out, err = cli_run(config_file, "log", "view", "events", "--format", "json")
    assert code == 0, err
    values = sorted(json.loads(json.loads(line)["value"])["n"] for line in out.splitlines())
    assert values == [0, 1, 2, 3, 4]
    code, _out, err = cli_run(config_file, "log", "append", "events", input=lines)
    assert code == 0, err


def test_second_up_on_the_same_log_fails_and_sigint_stops(
    config_file: Path, up_process: UpProcess
) -> None:
    up_process.wait_for_line("headwater: ready")

    second = subprocess.run(
        up_command(config_file),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=DEADLINE_S,
    )
    assert second.returncode == 1
    assert "error: HW-BUS-007: " in second.stderr
    assert "Traceback" not in second.stderr

    assert up_process.stop(signal.SIGINT) == 0
    up_process.wait_for_line("headwater: stopped")


def test_port_in_use_is_a_clean_error(config_file: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _out, err = cli_run(config_file, "up", "--port", str(port))
    assert code == 1
    assert err.startswith("error: ")
    assert "Traceback" not in err
