"""headwater's lean HTTP/1.1 client against real sockets: a raw asyncio server that answers with
exact bytes (Content-Length, chunked with trailers, up to the close, 204), counts connections
(keep-alive reuse), closes idle ones (a stale pooled connection is not used), stalls (the
timeout), and cuts an answer short (an error, and the connection is not reused)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from headwater.http.client import HttpClient, HttpError

Answer = Callable[[bytes], bytes | None]  # the request's bytes -> the answer (None: stall)


async def serve(answer: Answer, close_after: bool = False) -> tuple[asyncio.Server, list[int]]:
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                out = answer(head + body)
                if out is None:
                    await asyncio.sleep(3600)
                writer.write(out or b"")
                await writer.drain()
                if close_after or (out or b"").startswith(b"HTTP/1.0"):
                    break  # an HTTP/1.0 answer without a length ends at the close
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


def run(
    answer: Answer, go: Callable[[HttpClient, str, list[int]], Awaitable[None]], **kw: bool
) -> None:
    async def main() -> None:
        server, connections = await serve(answer, **kw)
        port = server.sockets[0].getsockname()[1]
        try:
            async with HttpClient() as client:
                await go(client, f"http://127.0.0.1:{port}/path?q=1", connections)
        finally:
            server.close()

    asyncio.run(main())


def test_content_length_answers_and_keep_alive_reuse() -> None:
    seen: list[bytes] = []

    def answer(request: bytes) -> bytes:
        seen.append(request)
        return b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nRetry-After: 3\r\n\r\nhello"

    async def go(client: HttpClient, url: str, connections: list[int]) -> None:
        for i in range(3):
            r = await client.request("POST", url, headers={"X-N": str(i)}, body=b"abc")
            assert (r.status, r.body, r.headers["retry-after"]) == (201, b"hello", "3")
        assert len(connections) == 1  # one connection, reused

    run(answer, go)
    assert seen[0].startswith(b"POST /path?q=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-N: 0\r\nContent-Length: 3\r\n\r\nabc" in seen[0]


def test_chunked_answers_with_trailers_and_answers_to_the_close() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\nwiki\r\n5;ext=1\r\npedia\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\nuntil the close",
    ]

    def answer(request: bytes) -> bytes:
        return answers.pop(0)

    async def go(client: HttpClient, url: str, connections: list[int]) -> None:
        assert (await client.request("GET", url)).body == b"wikipedia"
        assert (await client.request("GET", url)).status == 204
        assert (await client.request("GET", url)).body == b"until the close"

    run(answer, go)


def test_a_connection_the_server_closed_is_not_reused() -> None:
    def answer(request: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def go(client: HttpClient, url: str, connections: list[int]) -> None:
        for _ in range(3):
            assert (await client.request("POST", url, body=b"x")).body == b"ok"
            async with asyncio.timeout(10):  # until the server's close reaches the pool
                while any(c.usable() for conns in client._idle.values() for c in conns):
                    await asyncio.sleep(0.005)
        assert len(connections) == 3

    run(answer, go, close_after=True)


def test_timeouts_and_cut_answers_are_errors() -> None:
    answers: list[bytes | None] = [
        None,
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"not http at all\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ]

    def answer(request: bytes) -> bytes | None:
        return answers.pop(0)

    async def go(client: HttpClient, url: str, connections: list[int]) -> None:
        with pytest.raises(TimeoutError):
            await client.request("POST", url, body=b"x", timeout=0.3)
        with pytest.raises(HttpError, match="closed in the middle"):
            await client.request("POST", url, body=b"x")
        with pytest.raises(HttpError, match="not an HTTP answer"):
            await client.request("POST", url, body=b"x")
        assert (await client.request("POST", url, body=b"x")).body == b"ok"
        with pytest.raises(HttpError, match="cannot connect"):
            await client.request("GET", "http://127.0.0.1:1/")

    run(answer, go, close_after=True)
