"""The load's workload and what a load generator counts: one Raccoon ``SendEventRequest`` built
once, a distinct ``req_guid`` spliced into it per request, the response matched back by it."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from headwater.collector.protocols import raccoon

GUID_LEN = 36  # req_guid is 36 characters, like a UUID
OK_PREFIX = b"\x08\x01\x10\x01"  # SendEventResponse: status SUCCESS, code OK
USER_AGENT = "headwater-load"
MISMATCH = "the response names another request"


def request_template(events: int = 100, event_bytes: int = 200, seed: int = 7) -> bytes:
    """A serialized SendEventRequest of ``events`` random events of ``event_bytes`` (type
    ``click``) whose req_guid is 36 zeros, the first field: bytes 2..38 of the message."""
    rng = random.Random(seed)
    request: Any = raccoon.SendEventRequest(req_guid="0" * GUID_LEN)
    request.sent_time.GetCurrentTime()
    for _ in range(events):
        request.events.add(type="click", event_bytes=rng.randbytes(event_bytes))
    data: bytes = request.SerializeToString()
    if not data.startswith(b"\x0a" + bytes((GUID_LEN,)) + b"0" * GUID_LEN):
        raise RuntimeError("req_guid is not where it is expected in the serialized request")
    return data


def with_guid(template: bytes, guid: bytes) -> bytes:
    return b"".join((template[:2], guid, template[2 + GUID_LEN :]))


class Guids:
    """Distinct 36-byte request ids: a per-process, per-connection prefix and a counter."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.encode()
        self.width = GUID_LEN - len(self.prefix)
        self.seq = 0

    def next(self) -> bytes:
        self.seq += 1
        return self.prefix + b"%0*d" % (self.width, self.seq)


def response_problem(payload: bytes) -> tuple[bytes | None, str]:
    """(req_guid, "") of a success response, or (req_guid or None, reason) of anything else."""
    if payload.startswith(OK_PREFIX) and len(payload) > GUID_LEN:
        return payload[-GUID_LEN:], ""  # data{req_guid} is the last field of the response
    try:
        response: Any = raccoon.SendEventResponse.FromString(payload)
    except Exception as e:  # not a response at all
        return None, f"undecodable response: {e}"
    guid = response.data.get("req_guid", "")
    return (guid.encode() if guid else None), (
        f"status {response.status} code {response.code}: {response.reason}"
    )


def reply_problem(reply: bytes, guid: bytes) -> str:
    """What is wrong with ``reply`` as the answer to the request ``guid`` ("" when nothing)."""
    got, problem = response_problem(reply)
    if not problem and got != guid:
        return MISMATCH
    return problem


class Stats:
    """Acks counted and latencies kept inside the measured window."""

    def __init__(self) -> None:
        self.window = (float("inf"), float("inf"))
        self.latencies: list[float] = []
        self.errors = 0
        self.error_samples: list[str] = []
        self.unmatched = 0
        self.sent = 0

    def open_window(self, warmup: float, duration: float) -> None:
        """Count what is answered from ``warmup`` seconds from now, for ``duration``."""
        go = time.perf_counter()
        self.window = (go + warmup, go + warmup + duration)

    def ack(self, sent_at: float) -> None:
        now = time.perf_counter()
        if self.window[0] <= now < self.window[1]:
            self.latencies.append(now - sent_at)

    def error(self, reason: str) -> None:
        now = time.perf_counter()
        if self.window[0] <= now < self.window[1]:
            self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(reason[:200])

    def answered(self, problem: str, sent_at: float, label: str = "") -> None:
        """An answer: an ack sent at ``sent_at``, or an error (``problem``, a mismatched
        request counted as unmatched)."""
        if not problem:
            self.ack(sent_at)
            return
        if problem == MISMATCH:
            self.unmatched += 1
        self.error(f"{label}{problem}")

    async def measure(self, warmup: float, duration: float) -> float:
        """Open the window ``warmup`` seconds from now for ``duration`` seconds and wait it
        out; this process's CPU seconds over the window."""
        self.open_window(warmup, duration)
        await asyncio.sleep(warmup)
        cpu0 = time.process_time()
        await asyncio.sleep(duration)
        return time.process_time() - cpu0

    def result(self, cpu_s: float, window_s: float, **extra: object) -> dict[str, Any]:
        return {
            "acks": len(self.latencies),
            "latencies_us": [round(x * 1e6) for x in self.latencies],
            "errors": self.errors,
            "error_samples": self.error_samples,
            "unmatched": self.unmatched,
            "cpu_s": cpu_s,
            "window_s": window_s,
            **extra,
        }
