"""``headwater webhooks status SOURCE MESSAGE_ID``: a message's status, history and attempts
from the configured state, as text or one JSON object; an unknown message is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from headwater.cli.main import cli
from headwater.config.loader import load_config
from headwater.webhooks.state import Attempt, Status, open_state


def test_status_as_text_and_json(tmp_path: Path) -> None:
    config_path = tmp_path / "headwater.yaml"
    config_path.write_text(f"data_dir: {tmp_path / 'data'}\n")
    with open_state(load_config(config_path)) as store:
        store.arrive("github", "m1", "ci", b"{}", 1_700_000_000.0)
        store.record_attempt("github", "m1", Attempt(1_700_000_001.0, "deliver", 503, 12.0, "busy"))
        store.advance("github", "m1", Status.FAILED, 1_700_000_002.0, reason="gave up")
    runner = CliRunner()
    base = ["--config", str(config_path), "webhooks", "status", "github", "m1"]

    text = runner.invoke(cli, base)
    assert text.exit_code == 0, text.output
    assert "github/m1 -> ci: FAILED" in text.output and "reason: gave up" in text.output
    assert "deliver" in text.output and "503" in text.output and "busy" in text.output

    as_json = runner.invoke(cli, [*base, "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    shown = json.loads(as_json.output)
    assert shown["status"] == "FAILED" and shown["reason"] == "gave up"
    assert [h["status"] for h in shown["history"]] == ["ARRIVED", "FAILED"]
    assert shown["attempts"][0]["status_code"] == 503

    missing = runner.invoke(cli, [*base[:-1], "nope"])
    assert missing.exit_code != 0
    assert "no webhook message 'nope' from source 'github'" in missing.output
