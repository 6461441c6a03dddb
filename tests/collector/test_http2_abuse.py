"""Abuse of the gRPC port's HTTP/2, each against a real ``headwater collector`` process.

The intake runs in the collector's main process (``collector.workers: 1``), so the attacker's
connection and a well-behaved client share one event loop: the harder case for the well-behaved
one. For each attack the test asserts that the connection is ended with GOAWAY and the error
code RFC 9113 (or the attack's advisory) calls for, well before the attack is over; that the
collector spent bounded CPU and memory on it; and that a grpcio client calling on its own
connection all along was answered every time, within a bound of its latency before the attack.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hpack import Encoder
from tests.collector.test_grpc_server import GOOD_REQUEST

from headwater.collector import http2 as h2
from headwater.collector.grpc_server import RESET_BURST, length_prefixed
from headwater.collector.protocols import raccoon
from headwater.testing.collector import CollectorProcess, collector_with_grpc
from headwater.testing.proc_tree import rss
from headwater.testing.waiting import wait_until

CHUNK = 64 * 1024  # the attacker writes this much at a time, reading the server's frames between
CPU_BOUND_S = 3.0  # the collector's CPU time on one attack (all of it, the probe's calls too)
MEMORY_BOUND = 64 << 20  # growth of its resident memory
SLOWER_BOUND = 0.25  # the probe's calls during an attack may be this many seconds over its p99


def _message(guid: str) -> bytes:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    req.events.add(event_bytes=b"e" * 40, type="abuse")
    return req.SerializeToString()


@dataclass
class Target:
    process: CollectorProcess
    port: int

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("abuse")
    with collector_with_grpc(root, "  workers: 1") as (process, port):
        yield Target(process, port)


class Probe:
    """A grpcio client calling ``SendEvent`` one call after another on its own connection."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self.channel.unary_unary(raccoon.METHOD)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def one(self) -> None:
        start = time.perf_counter()
        try:
            reply = raccoon.SendEventResponse.FromString(self.call(_message("probe"), timeout=10))
            if reply.status != raccoon.Status.SUCCESS:
                self.failures.append(reply.reason)
        except grpc.RpcError as e:
            self.failures.append(str(e))
        self.latencies.append(time.perf_counter() - start)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.one()

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100)[98]


async def _attack(port: int, chunks: Iterator[bytes]) -> tuple[int, int]:
    """Send ``chunks`` after the preface, reading the server's frames all along; returns the
    GOAWAY's error code and last stream id once the server ends the connection. A connection
    that is never ended fails the test (at the read's deadline)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(h2.PREFACE + h2.settings_frame({}))

    async def goaway() -> tuple[int, int]:
        buffer = b""
        while data := await reader.read(1 << 16):
            buffer += data
            while len(buffer) >= h2.FRAME_HEAD_SIZE:
                high, low, kind, _, _ = h2.FRAME_HEAD.unpack_from(buffer)
                end = h2.FRAME_HEAD_SIZE + (high << 8 | low)
                if len(buffer) < end:
                    break
                payload, buffer = buffer[h2.FRAME_HEAD_SIZE : end], buffer[end:]
                if kind == h2.GOAWAY:
                    return h2.u32(payload[4:8]), h2.u32(payload[:4])
        raise AssertionError("the connection was closed without a GOAWAY")

    reading = asyncio.ensure_future(goaway())
    try:
        for chunk in chunks:
            if reading.done():
                break
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass  # ended by the server while writing: its GOAWAY was read or is still to read
    try:
        return await asyncio.wait_for(reading, 30)
    finally:
        writer.close()


def _chunked(frames: Iterator[bytes]) -> Iterator[bytes]:
    out: list[bytes] = []
    size = 0
    for f in frames:
        out.append(f)
        size += len(f)
        if size >= CHUNK:
            yield b"".join(out)
            out, size = [], 0
    if out:
        yield b"".join(out)


def rapid_reset() -> Iterator[bytes]:
    """CVE-2023-44487: a whole call, at once cancelled, 10,000 times."""
    encoder = Encoder()
    data = length_prefixed(_message("reset"))
    for i in range(10_000):
        stream = 2 * i + 1
        yield h2.frame(h2.HEADERS, h2.END_HEADERS, stream, encoder.encode(GOOD_REQUEST))
        yield h2.frame(h2.DATA, h2.END_STREAM, stream, data)
        yield h2.rst_stream(stream, h2.CANCEL)


def made_you_reset() -> Iterator[bytes]:
    """CVE-2025-8671: requests the server must reset (a header name in upper case), 10,000."""
    encoder = Encoder()
    block = [*GOOD_REQUEST, ("X-Upper", "1")]
    for i in range(10_000):
        yield h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 2 * i + 1, encoder.encode(block))


def continuation_flood() -> Iterator[bytes]:
    """CVE-2024-27316: a header block that never ends, in empty CONTINUATION frames."""
    yield h2.frame(h2.HEADERS, 0, 1, Encoder().encode(GOOD_REQUEST))
    for _ in range(100_000):
        yield h2.frame(h2.CONTINUATION, 0, 1)


def settings_flood() -> Iterator[bytes]:
    for _ in range(100_000):
        yield h2.settings_frame({h2.INITIAL_WINDOW_SIZE: 65_535})


def ping_flood() -> Iterator[bytes]:
    for i in range(100_000):
        yield h2.frame(h2.PING, 0, 0, i.to_bytes(8, "big"))


def priority_flood() -> Iterator[bytes]:
    for i in range(100_000):
        yield h2.frame(h2.PRIORITY, 0, 2 * i + 1, (0).to_bytes(4, "big") + b"\x10")


def hpack_bomb() -> Iterator[bytes]:
    """One 4 kB value put in the decoder's table, then a block of 1,000 one-byte references
    to it: 1 kB on the wire, 4 MB of headers once decoded."""
    value = b"v" * 4000
    entry = b"\x40\x05x-pad" + b"\x7f" + _hpack_int(len(value) - 127) + value
    first = Encoder().encode(GOOD_REQUEST) + entry  # literal with incremental indexing
    yield h2.frame(h2.HEADERS, h2.END_HEADERS, 1, first)
    yield h2.frame(h2.HEADERS, h2.END_HEADERS, 3, b"\xbe" * 1000)  # index 62: the entry


def _hpack_int(rest: int) -> bytes:
    out = bytearray()
    while rest >= 128:
        out.append(rest & 0x7F | 0x80)
        rest >>= 7
    out.append(rest)
    return bytes(out)


ATTACKS: dict[str, tuple[Callable[[], Iterator[bytes]], int, int, str]] = {
    # name: (frames, the GOAWAY's code, streams the server may open before, what it logs)
    "rapid-reset": (rapid_reset, h2.ENHANCE_YOUR_CALM, RESET_BURST + 200, "rapid reset"),
    "made-you-reset": (made_you_reset, h2.ENHANCE_YOUR_CALM, RESET_BURST + 200, "rapid reset"),
    "continuation-flood": (continuation_flood, h2.ENHANCE_YOUR_CALM, 0, "CONTINUATION frames"),
    "settings-flood": (settings_flood, h2.ENHANCE_YOUR_CALM, 0, "a flood of SETTINGS"),
    "ping-flood": (ping_flood, h2.ENHANCE_YOUR_CALM, 0, "a flood of PING"),
    "priority-flood": (priority_flood, h2.ENHANCE_YOUR_CALM, 0, "a flood of PRIORITY"),
    "hpack-bomb": (hpack_bomb, h2.COMPRESSION_ERROR, 1, "cannot be decoded"),
}


@pytest.mark.parametrize(
    ("frames", "code", "streams", "logged"), ATTACKS.values(), ids=ATTACKS.keys()
)
def test_an_attack_ends_its_connection_and_others_are_served(
    target: Target, frames: Callable[[], Iterator[bytes]], code: int, streams: int, logged: str
) -> None:
    baseline = Probe(target.port)
    for _ in range(200):
        baseline.one()
    assert not baseline.failures
    usual = baseline.p99()
    baseline.channel.close()
    log_start = target.process.stderr_path.stat().st_size

    chunks = list(_chunked(frames()))  # made before: the attacker spends no CPU on them
    cpu, memory = target.cpu_s(), rss(target.pid)
    with Probe(target.port) as probe:
        wait_until(lambda: len(probe.latencies) >= 20, "the probe is calling", 30)
        before = len(probe.latencies)
        got, last_stream = asyncio.run(_attack(target.port, iter(chunks)))
        during = probe.latencies[before:]
        wait_until(lambda: len(probe.latencies) > before + len(during), "a call after", 30)
    probe.channel.close()
    spent, grown = target.cpu_s() - cpu, rss(target.pid) - memory

    assert got == code, f"GOAWAY with error code {got}, not {code}"
    assert last_stream <= 2 * streams, f"streams up to {last_stream} were opened"
    assert spent < CPU_BOUND_S, f"the collector spent {spent:.2f} s of CPU"
    assert grown < MEMORY_BOUND, f"the collector grew by {grown >> 20} MiB"
    assert not probe.failures, probe.failures[:3]
    # every call that overlapped the attack (the one it was in when the attack began too)
    worst = max([*during, probe.latencies[before + len(during)]])
    assert worst < usual + SLOWER_BOUND, f"a call took {worst * 1000:.1f} ms ({usual=})"
    assert target.process.proc.poll() is None  # the collector runs on
    wait_until(
        lambda: logged in target.process.stderr()[log_start:],
        f"the collector logs why it ended the connection ({logged!r})",
        10,
    )
