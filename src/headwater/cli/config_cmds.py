"""``headwater config ...``: check a config file and show the effective settings."""

from __future__ import annotations

from pathlib import Path

import click

from headwater.cli.context import config_option, config_path, format_option
from headwater.cli.output import echo_json, table
from headwater.config.loader import (
    DEFAULT_CONFIG_FILE,
    InvalidConfig,
    LoadedConfig,
    read_config,
)
from headwater.config.model import HeadwaterConfig
from headwater.ops.masking import redact


@click.group("config")
def config_group() -> None:
    """The config file (headwater.yaml)."""


@config_group.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@config_option
@format_option
@click.pass_context
def check(ctx: click.Context, file: Path | None, fmt: str) -> None:
    """Validate FILE (default: --config, else ./headwater.yaml) with the HEADWATER_* env
    overrides, and show the effective settings.

    Each problem is named by its key, file, line and column (or env variable). Exits 1 when the
    configuration is invalid.
    """
    path = file if file is not None else config_path(ctx)
    try:
        loaded = read_config(path)
    except InvalidConfig as exc:
        if fmt == "json":
            echo_json(
                {
                    "ok": False,
                    "file": str(exc.file) if exc.file is not None else None,
                    "errors": [issue.to_dict() for issue in exc.issues],
                }
            )
        else:
            click.echo(f"error: {exc}", err=True)
        ctx.exit(1)
        return

    if fmt == "json":
        echo_json(
            {
                "ok": True,
                "file": str(loaded.file) if loaded.file is not None else None,
                "defaults": loaded.file is None,
                "env_overrides": dict(loaded.env_overrides),
                "config": redact(loaded.config.model_dump(mode="json")),
                "errors": [],
            }
        )
        return
    click.echo(_summary(loaded))


def _summary(loaded: LoadedConfig) -> str:
    if loaded.file is None:
        head = f"OK: no config file ({DEFAULT_CONFIG_FILE} not found); using the defaults"
    else:
        head = f"OK: {loaded.file} is valid"
    lines = [head, "", table(["SETTING", "VALUE"], _settings(loaded.config))]
    if loaded.env_overrides:
        rows = [[key, var] for key, var in loaded.env_overrides.items()]
        lines += ["", table(["SET FROM ENV", "VARIABLE"], rows)]
    return "\n".join(lines)


def _settings(config: HeadwaterConfig) -> list[list[object]]:
    bus = config.bus
    rows: list[list[object]] = [
        ["data_dir", config.data_dir],
        ["bus.backend", bus.backend],
    ]
    if bus.backend == "embedded":
        emb = bus.embedded
        rows += [
            ["log directory", config.log_dir()],
            ["bus.embedded.durability", emb.durability],
            ["bus.embedded.segment_bytes", emb.segment_bytes],
            ["bus.embedded.max_record_bytes", emb.max_record_bytes],
            ["bus.embedded.default_partitions", emb.default_partitions],
            ["bus.embedded.retention.bytes", emb.retention.bytes],
            ["bus.embedded.retention.ms", emb.retention.ms],
        ]
    else:
        kafka = bus.kafka
        rows += [
            ["bus.kafka.bootstrap_servers", kafka.bootstrap_servers],
            ["bus.kafka.default_partitions", kafka.default_partitions],
            ["bus.kafka.replication_factor", kafka.replication_factor],
            ["bus.kafka.max_record_bytes", kafka.max_record_bytes],
        ]
    return rows
