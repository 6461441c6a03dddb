"""headwater's HTTP/1.1 client against a hostile server: an asyncio TCP server (TLS optional)
that reads each request and plays the next scripted answer byte for byte: heads over the limit
or without end, chunk-size lines that are not hex or say 2^64-1, bodies cut short or without
end, one byte at a time, 1xx answers before the final one, a connection closed or reset under a
request sent on a pooled connection, certificates that are not trusted or name another host,
and answers that break RFC 9112's framing rules. Each case ends in ``HttpError`` or
``TimeoutError`` within the request's timeout, the memory the exchange allocates stays under a
few MB (tracemalloc around the call), and the cases the RFC allows are answered correctly."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from headwater.http.client import MAX_HEAD_BYTES, HttpClient, HttpError
from headwater.testing.tls import CertificateAuthority, self_signed

Action = Callable[[asyncio.StreamWriter], Awaitable[None]]
Part = bytes | Action
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
MiB = 1024 * 1024


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()


async def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0) instead of a FIN."""
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    writer.transport.abort()


def endless(unit: bytes) -> Action:
    """``unit`` again and again, as fast as the client reads, until it goes away."""

    async def play(writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            writer.write(unit)
            await writer.drain()

    return play


def drip(data: bytes, every: float, size: int = 1) -> Action:
    """``data`` ``size`` bytes at a time, ``every`` seconds apart."""

    async def play(writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(data), size):
            writer.write(data[i : i + size])
            await writer.drain()
            await asyncio.sleep(every)

    return play


def stall(writer: asyncio.StreamWriter) -> Awaitable[None]:
    return asyncio.Event().wait()


@dataclass
class Hostile:
    """Plays ``script`` (one list of parts per request, in arrival order on any connection)."""

    script: list[list[Part]]
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection, request)
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number, self.connections = self.connections, self.connections + 1
        try:
            while not writer.is_closing():
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                length = next((int(h[15:]) for h in lines if h.startswith(b"content-length:")), 0)
                self.requests.append((number, head + await reader.readexactly(length)))
                for part in self.script.pop(0):
                    if isinstance(part, bytes):
                        writer.write(part)
                        await writer.drain()
                    else:
                        await part(writer)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        except asyncio.CancelledError:  # the test is over
            pass
        finally:
            writer.close()


Go = Callable[[HttpClient, str, Hostile], Awaitable[None]]


def run(
    script: list[list[Part]],
    go: Go,
    *,
    server_tls: ssl.SSLContext | None = None,
    client_tls: ssl.SSLContext | None = None,
    max_body_bytes: int = 16 * MiB,
) -> Hostile:
    hostile = Hostile(script)

    async def main() -> None:
        server = await asyncio.start_server(hostile.handle, "127.0.0.1", 0, ssl=server_tls)
        port = server.sockets[0].getsockname()[1]
        scheme = "https" if server_tls else "http"
        try:
            client = HttpClient(ssl_context=client_tls, max_body_bytes=max_body_bytes)
            async with client:
                await go(client, f"{scheme}://127.0.0.1:{port}/hook", hostile)
        finally:
            server.close()

    asyncio.run(main())
    return hostile


@contextmanager
def memory_under(limit: int) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak} bytes allocated at the peak, limit {limit}"


def fails(script: list[Part], match: str, memory: int = 2 * MiB, **kw: int) -> Hostile:
    """The request ends in ``HttpError`` matching ``match``, within 5 s, under ``memory``."""

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        with memory_under(memory), pytest.raises(HttpError, match=match):
            await client.request("POST", url, body=b"x", timeout=5)

    return run([script], go, **kw)


# Heads: over the limit, or without end.

HEAD_OVER = f"head is over {MAX_HEAD_BYTES} bytes"


@pytest.mark.parametrize(
    "script",
    [
        [b"HTTP/1.1 200 ", endless(b"a" * 4096)],  # an endless status line
        [b"HTTP/1.1 200 OK\r\nX-Long: ", endless(b"a" * 4096)],  # an endless header line
        [b"HTTP/1.1 200 OK\r\n", endless(b"X-Many: header\r\n")],  # endless header lines
        [b"HTTP/1.1 100 Continue\r\n", endless(b"X-Many: header\r\n")],  # in a 1xx answer
    ],
    ids=["status-line", "header-line", "header-lines", "interim-head"],
)
def test_an_oversize_head_is_an_error_with_bounded_memory(script: list[Part]) -> None:
    fails(script, HEAD_OVER)


# Chunked bodies with bad or huge chunk sizes.

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"zz\r\nhello\r\n0\r\n\r\n", "not a valid chunk size line"),
        (b"-5\r\nhello\r\n0\r\n\r\n", "not a valid chunk size line"),
        (b"+5\r\nhello\r\n0\r\n\r\n", "not a valid chunk size line"),
        (b"0x5\r\nhello\r\n0\r\n\r\n", "not a valid chunk size line"),
        (b"5\nhello\r\n0\r\n\r\n", "not a valid chunk size line"),  # a bare LF
        (b"5\r\nhelloXX0\r\n\r\n", "not followed by CRLF"),
        (b"5\r\nhello0\r\n\r\n", "not followed by CRLF"),
    ],
    ids=["not-hex", "negative", "plus-sign", "0x", "bare-lf", "no-crlf", "crlf-missing"],
)
def test_a_bad_chunk_is_an_error(body: bytes, match: str) -> None:
    fails([CHUNKED + body, stall], match)  # the server keeps the connection open


def test_a_huge_chunk_size_fails_before_its_data_is_read() -> None:
    hostile = fails([CHUNKED + b"ffffffffffffffff\r\n", endless(b"a" * 65536)], "body is over")
    assert hostile.connections == 1


@pytest.mark.parametrize(
    "script",
    [
        [CHUNKED + b"1", endless(b"0" * 4096)],  # an endless chunk size line
        [CHUNKED + b"0\r\n", endless(b"X-Trailer: t\r\n")],  # endless trailers
    ],
    ids=["chunk-size-line", "trailers"],
)
def test_endless_chunk_lines_are_errors(script: list[Part]) -> None:
    fails(script, f"over {MAX_HEAD_BYTES} bytes")


# Bodies cut short, or over the client's bound.


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        CHUNKED + b"10\r\nonly ten b",
        CHUNKED + b"5\r\nhello\r\n",
    ],
    ids=["content-length", "in-a-chunk", "before-last-chunk"],
)
def test_a_body_cut_short_by_the_close_is_an_error(answer: bytes) -> None:
    fails([answer, close], "closed in the middle of the answer")


@pytest.mark.parametrize(
    "script",
    [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1048577\r\n\r\n", stall],  # refused unread
        [CHUNKED, endless(b"10000\r\n" + b"a" * 65536 + b"\r\n")],
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", endless(b"a" * 65536)],
    ],
    ids=["content-length", "chunked", "until-the-close"],
)
def test_a_body_over_the_clients_bound_is_an_error(script: list[Part]) -> None:
    fails(script, "body is (1048577 bytes, )?over 1048576", memory=3 * MiB, max_body_bytes=MiB)


def test_a_body_to_the_close_is_read_to_the_close() -> None:
    body = bytes(range(256)) * 8

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        response = await client.request("GET", url, timeout=10)
        assert response.body == body

    # in pieces 10 ms apart, so several reads; the body ends with the connection
    run([[b"HTTP/1.0 200 OK\r\n\r\n", drip(body, 0.01, size=256), close]], go)


# One byte a second: the whole exchange's deadline ends it.


@pytest.mark.parametrize(
    "answer", [OK, b"HTTP/1.1 200 OK\r\n" + b"X-Slow: header\r\n" * 100], ids=["answer", "head"]
)
def test_a_server_dripping_bytes_is_ended_by_the_total_deadline(answer: bytes) -> None:
    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.request("GET", url, timeout=1.0)
        assert 1.0 <= time.monotonic() - started < 1.5

    run([[drip(answer, 0.05)]], go)  # each read is answered within 50 ms


# 1xx answers before the final one.


def test_interim_answers_are_skipped() -> None:
    interim = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 102 Processing\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </script.js>; rel=preload\r\n\r\n"
    )
    final = b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\nLocation: /m/1\r\n\r\ndone"

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        for _ in range(2):
            response = await client.request("POST", url, body=b"event", timeout=5)
            assert (response.status, response.body) == (201, b"done")
            assert "link" not in response.headers
            assert response.headers["location"] == "/m/1"
        assert hostile.connections == 1

    run([[interim, final], [b"HTTP/1.1 100 Continue\r\n\r\n", final]], go)


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (b"HTTP/1.1 103 Early Hints\r\n\r\n" * 17, "more than 16 1xx answers"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", "101"),
    ],
    ids=["too-many", "unasked-upgrade"],
)
def test_interim_answers_without_end_or_an_upgrade_are_errors(head: bytes, match: str) -> None:
    fails([head, OK], match)


# A pooled connection closed by the server under a request.


@pytest.mark.parametrize("end", [close, reset], ids=["closed", "reset"])
@pytest.mark.parametrize(
    ("method", "headers", "retried"),
    [
        ("GET", {}, True),
        ("PUT", {}, True),
        ("DELETE", {}, True),
        ("POST", {"Idempotency-Key": "k-1"}, True),
        ("POST", {"webhook-id": "msg_1"}, True),
        ("POST", {}, False),
        ("PATCH", {}, False),
    ],
)
def test_a_request_on_a_pooled_connection_the_server_ended_is_retried_only_when_safe(
    end: Action, method: str, headers: dict[str, str], retried: bool
) -> None:
    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        assert (await client.request(method, url, headers=headers, timeout=5)).body == b"ok"
        if retried:
            response = await client.request(method, url, headers=headers, timeout=5)
            assert response.body == b"ok"
        else:
            with pytest.raises(HttpError, match="before an answer"):
                await client.request(method, url, headers=headers, timeout=5)

    hostile = run([[OK], [end], [OK]], go)
    assert [c for c, _ in hostile.requests] == ([0, 0, 1] if retried else [0, 0])
    if retried:  # the same request again
        assert hostile.requests[2][1] == hostile.requests[1][1]


@pytest.mark.parametrize("end", [close, reset], ids=["closed", "reset"])
def test_a_new_connection_that_ends_before_an_answer_is_not_retried(end: Action) -> None:
    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        with pytest.raises(HttpError, match="before an answer"):
            await client.request("GET", url, timeout=5)

    assert len(run([[end], [OK]], go).requests) == 1


# TLS: the handshake fails, the certificate is not trusted or names another host.


def test_tls_with_a_trusted_certificate_for_the_host_works_and_is_reused() -> None:
    ca = CertificateAuthority()

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        for _ in range(2):
            assert (await client.request("GET", url, timeout=5)).body == b"ok"
        assert hostile.connections == 1

    server = ca.issue("127.0.0.1").server_context()
    run([[OK], [OK]], go, server_tls=server, client_tls=ca.client_context())


@pytest.mark.parametrize(
    ("server", "trusted", "match"),
    [
        ("self-signed", False, "certificate is not accepted: self.signed certificate"),
        ("other CA", True, "certificate is not accepted: unable to get local issuer"),
        ("other host", True, "certificate is not accepted: IP address mismatch"),
    ],
)
def test_a_certificate_not_trusted_or_for_another_host_is_an_error_naming_the_host(
    server: str, trusted: bool, match: str
) -> None:
    ca = CertificateAuthority()
    cert = {
        "self-signed": self_signed("127.0.0.1"),
        "other CA": CertificateAuthority("another CA").issue("127.0.0.1"),
        "other host": ca.issue("other.example", "10.9.9.9"),
    }[server]

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        port = url.split(":")[2].split("/")[0]
        with pytest.raises(HttpError, match=rf"GET https://127\.0\.0\.1:{port}: TLS: .*{match}"):
            await client.request("GET", url, timeout=5)
        assert hostile.requests == []

    client_tls = ca.client_context() if trusted else None
    run([], go, server_tls=cert.server_context(), client_tls=client_tls)


def test_a_server_not_speaking_tls_is_an_error_naming_the_host() -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the ClientHello, answered as a plain HTTP server would
        writer.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(plain, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, HttpClient() as client:
            with pytest.raises(
                HttpError, match=rf"https://127\.0\.0\.1:{port}: TLS handshake failed"
            ):
                await client.request("GET", f"https://127.0.0.1:{port}/", timeout=5)

    asyncio.run(main())


def test_a_tls_server_that_never_answers_the_handshake_times_out() -> None:
    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # the server waits for a request that never comes
            await client.request("GET", url.replace("http:", "https:"), timeout=0.5)
        assert time.monotonic() - started < 1.0

    run([], go)


# Framing rules (RFC 9112 sections 4 to 6).


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "not an HTTP answer"),
        (b"ICY 200 OK\r\nContent-Length: 2\r\n\r\nok", "not an HTTP answer"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok", "not an HTTP answer"),
        (b"HTTP/1.1 099 Low\r\nContent-Length: 2\r\n\r\nok", "not an HTTP answer"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok", "no colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok", "not a valid header name"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok", "CR, LF or NUL"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok", "not a valid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "did not ask for"),
        (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", "1.0"),
    ],
    ids=[
        "http2",
        "icy",
        "4-digit-status",
        "status-under-100",
        "no-colon",
        "space-before-colon",
        "bare-cr",
        "two-lengths",
        "length-list",
        "signed-length",
        "gzip-coding",
        "http10-chunked",
    ],
)
def test_answers_breaking_the_framing_rules_are_errors(answer: bytes, match: str) -> None:
    fails([answer, stall], match)


def test_answers_the_rules_allow_are_read_and_framed_right() -> None:
    script: list[list[Part]] = [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok"],
        [b"HTTP/1.1 200 OK\r\nX-Folded: one\r\n  two\r\nContent-Length: 2\r\n\r\nok"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"],  # to HEAD: no body
        [b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"],
        [b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"],
        [OK],  # still in step on the one connection
        [CHUNKED[:-2] + b"Content-Length: 9\r\n\r\n2\r\nok\r\n0\r\n\r\n"],  # chunked wins
        [OK],  # on a new connection
    ]

    async def go(client: HttpClient, url: str, hostile: Hostile) -> None:
        async def get(method: str = "GET") -> tuple[int, bytes]:
            response = await client.request(method, url, timeout=5)
            return response.status, response.body

        assert await get() == (200, b"ok")
        assert (await client.request("GET", url, timeout=5)).headers["x-folded"] == "one two"
        assert await get("HEAD") == (200, b"")
        assert await get() == (204, b"")
        assert await get() == (304, b"")
        assert await get() == (200, b"ok")
        assert hostile.connections == 1
        assert await get() == (200, b"ok")
        assert await get() == (200, b"ok")
        assert hostile.connections == 2

    run(script, go)
