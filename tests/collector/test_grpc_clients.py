"""Another gRPC implementation against the collector's gRPC port: @grpc/grpc-js, on Node's own
HTTP/2 (nghttp2). ``test_grpc_server.py`` drives the port with grpc.aio, on gRPC's C core; the
collector speaks HTTP/2 itself, so each client implementation is a check of its own.

``scripts/bootstrap.sh`` installs @grpc/grpc-js (``tests/collector/grpc_js``) into
``~/.cache/headwater/grpc-js``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.testing.collector import RunningCollector

CLIENT = Path(__file__).parent / "grpc_js" / "client.js"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
NODE_MODULES = CACHE / "headwater" / "grpc-js" / "node_modules"
WORKERS, CALLS, EVENTS = 10, 10, 20


def test_a_grpc_js_client_is_served_and_its_events_stored(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    if not (NODE_MODULES / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"@grpc/grpc-js is not installed in {NODE_MODULES}: run scripts/bootstrap.sh")
    done = subprocess.run(
        ["node", str(CLIENT), server.grpc_target, str(WORKERS), str(CALLS), str(EVENTS)],
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    out = json.loads(done.stdout)
    # every call answered SUCCESS, half of them gzip-compressed, 10 in flight on one channel
    assert out["problems"] == []
    assert out["ok"] == WORKERS * CALLS
    assert out["other"][0] == 12  # UNIMPLEMENTED
    assert "EventService/Other" in out["other"][1]
    assert out["big"][0] == 8  # RESOURCE_EXHAUSTED, naming the sizes
    assert str(6 * 1024 * 1024) in out["big"][1] and "over the limit" in out["big"][1]
    stored = [r.value for r in bus.read("clickstream-grpcjs-log", 0, 0, max_records=10_000)]
    expected = {
        f"js-{w}-{i}/{e}".encode()
        for w in range(WORKERS)
        for i in range(CALLS)
        for e in range(EVENTS)
    }
    assert len(stored) == len(expected) and set(stored) == expected
