"""A lean HTTP/1.1 client for the requests headwater sends one by one: webhook deliveries, status
polls and callbacks. Measured in ``bench/webhooks.py``: aiohttp's client took about 23% of the
webhook workers' event loop for two requests per message, most of it in its request machinery
(tracing hooks, cookie jars, redirects, per-request objects) that these requests never use.

What it does: keep-alive connections pooled per ``(scheme, host, port)`` (reused newest first;
one whose peer has closed it is dropped before use), TLS for ``https`` (the system's
certificates, the host name checked), bodies sent with ``Content-Length``, answers read by
``Content-Length``, ``chunked`` or up to the close, a whole-exchange timeout (``TimeoutError``),
and every other failure as ``HttpError`` (an ``OSError``: the connection is closed, never
reused). What it does not: redirects, cookies, proxies, compression of answers (it asks for none).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
_NO_BODY = frozenset({204, 304})


class HttpError(OSError):
    """The exchange failed: no (complete) answer."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names (a repeated header: the last one)
    body: bytes


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    def __init__(
        self,
        user_agent: str = "headwater",
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``before``: awaited before each request is sent (the webhook workers commit their
        state's changes there: a request is never sent ahead of what it depends on)."""
        self.user_agent = user_agent
        self.before = before
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        timeout: float = 30.0,
    ) -> Response:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        origin = (parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        head = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"User-Agent: {self.user_agent}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        if self.before is not None:
            await self.before()
        async with asyncio.timeout(timeout):
            conn = await self._connection(origin)
            try:
                conn.writer.write(payload)
                response, keep = await _read_response(conn.reader, method)
            except BaseException:
                conn.close()
                raise
        if keep and not self._closed:
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        return response

    async def _connection(self, origin: tuple[str, str, int]) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        scheme, host, port = origin
        context = self._tls() if scheme == "https" else None
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=context, limit=MAX_HEAD_BYTES
            )
        except OSError as e:
            raise HttpError(f"cannot connect to {host}:{port}: {e}") from None
        return _Connection(reader, writer)

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[Response, bool]:
    """The answer, and whether the connection may be used again."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed before an answer") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"the answer's head is over {MAX_HEAD_BYTES} bytes") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        version, code = lines[0].split(" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise HttpError(f"not an HTTP answer: {lines[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    try:
        if method == "HEAD" or status in _NO_BODY or 100 <= status < 200:
            body = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _chunked(reader)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if length > MAX_BODY_BYTES:
                raise HttpError(f"the answer's body is {length} bytes, over {MAX_BODY_BYTES}")
            body = await reader.readexactly(length)
        else:
            body = await reader.read(MAX_BODY_BYTES)  # up to the close
            keep = False
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed in the middle of the answer") from None
    except ValueError:
        raise HttpError("the answer's body framing is not valid") from None
    return Response(status, headers, body), keep


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return bytes(out)
        if len(out) + size > MAX_BODY_BYTES:
            raise HttpError(f"the answer's body is over {MAX_BODY_BYTES} bytes")
        out += await reader.readexactly(size)
        await reader.readexactly(2)
