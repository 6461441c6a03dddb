"""A lean HTTP/1.1 client for the requests headwater sends one by one: webhook deliveries, status
polls and callbacks. Measured in ``bench/webhooks.py``: aiohttp's client took about 23% of the
webhook workers' event loop for two requests per message, most of it in its request machinery
(tracing hooks, cookie jars, redirects, per-request objects) that these requests never use.

What it does: keep-alive connections pooled per ``(scheme, host, port)`` (reused newest first),
TLS for ``https`` (the system's certificates unless an ``ssl_context`` is given, the host name
checked), bodies sent with ``Content-Length``, answers read by ``Content-Length``, ``chunked`` or
up to the close. What it does not: redirects, cookies, proxies, compression of answers (it asks
for none), transfer codings other than ``chunked``, protocol upgrades.

Failures: ``timeout`` bounds the whole exchange (connecting, the TLS handshake, writing, every
byte of the answer; a server that sends one byte a second is ended by it, not by a per-read
limit) and ends in ``TimeoutError``. Every other failure is an ``HttpError`` (an ``OSError``)
whose message starts with the method and origin; its connection is closed, never reused.

Bounds on what one answer can make it hold: a head (status line and header section, of each 1xx
answer too) of at most ``MAX_HEAD_BYTES``, and a chunk-size line or trailer section likewise; at
most ``MAX_INTERIM`` 1xx answers before the final one (they are skipped; ``101`` is an error, as
the client asks for no upgrade); a body of at most ``max_body_bytes`` (``MAX_BODY_BYTES`` by
default), refused before reading when ``Content-Length`` or a chunk's size says more. Answers are
checked as RFC 9112 asks: a status line that is not ``HTTP/1.x NNN``, a header line without a
colon or with an invalid name, Content-Length values that disagree or are not digits, transfer
codings other than ``chunked``, and a chunk-size line that is not hex digits (or a chunk not
followed by CRLF) are errors. An answer with both ``Transfer-Encoding: chunked`` and
``Content-Length`` is read as chunked and its connection then closed (RFC 9112 6.3). Answers to
``HEAD`` and ``204``/``304`` answers have no body, whatever their headers say.

Retries (RFC 9112 9.3.1, RFC 9110 9.2.2). A pooled connection whose end the client has already
seen (the server closed it while idle) is dropped before anything is written to it, and the
request goes on another connection: nothing was sent, so this holds for every method. A request
written to a reused connection that then ends (closed or reset) before a single byte of an answer
arrives may or may not have reached the server: a server closing an idle connection as the
request crosses looks the same as one that took the request and died. Such a request is sent
again, once, on a new connection, only when repeating it is safe: its method is idempotent
(``GET``, ``HEAD``, ``OPTIONS``, ``TRACE``, ``PUT``, ``DELETE``) or it carries an
``Idempotency-Key`` header (HTTP delivery's requests do) or a ``webhook-id`` (every webhook
sent: Standard Webhooks receivers drop a message id they have seen). Any
other request fails with ``HttpError`` ("... before an answer") and its caller decides. Nothing
is retried after a new connection fails, after any byte of an answer, or on a timeout.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from headwater.http.framing import (
    MAX_INTERIM,
    Body,
    HttpError,
    chunk_size,
    framing,
    parse_head,
)

__all__ = ["MAX_BODY_BYTES", "MAX_HEAD_BYTES", "HttpClient", "HttpError", "Response"]

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
_READ_BYTES = 64 * 1024
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
REPEAT_SAFE = frozenset({"idempotency-key", "webhook-id"})
TARGETS_KEPT = 1024  # parsed URLs kept by a client
"""Headers that make any request safe to send twice: the receiver drops a repeat of their value."""
Origin = tuple[str, str, int]


class _Unanswered(HttpError):
    """The connection ended before any byte of an answer."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names (a repeated header: the last one)
    body: bytes


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    def __init__(
        self,
        user_agent: str = "headwater",
        before: Callable[[], Awaitable[None]] | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        """``before``: awaited before each request is sent (the webhook workers commit their
        state's changes there: a request is never sent ahead of what it depends on).
        ``ssl_context``: the certificates trusted for ``https`` (default: the system's).
        ``max_body_bytes``: the largest answer body accepted."""
        self.user_agent = user_agent
        self.before = before
        self.max_body_bytes = max_body_bytes
        self._idle: dict[Origin, list[_Connection]] = {}
        self._targets: dict[str, tuple[Origin, str, str]] = {}
        self._ssl = ssl_context
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
        origin, target, host = self._target(url)
        head = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"User-Agent: {self.user_agent}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        repeatable = method in IDEMPOTENT or any(k.lower() in REPEAT_SAFE for k in headers or {})
        if self.before is not None:
            await self.before()
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection(origin)
                try:
                    response, keep = await self._exchange(conn, payload, method)
                except _Unanswered:
                    if not (conn.reused and repeatable):
                        raise
                    conn = await self._connect(origin)
                    response, keep = await self._exchange(conn, payload, method)
        except HttpError as e:
            raise HttpError(f"{method} {origin[0]}://{host}: {e}") from None
        if keep and not self._closed:
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        return response

    def _target(self, url: str) -> tuple[Origin, str, str]:
        """The origin, request target and Host of ``url`` (parsed once: a client sends to the
        same few URLs again and again)."""
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        origin = (parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        if len(self._targets) >= TARGETS_KEPT:  # (URLs made per message: a poll's status URL)
            self._targets.clear()
        found = self._targets[url] = (origin, target, host)
        return found

    async def _exchange(
        self, conn: _Connection, payload: bytes, method: str
    ) -> tuple[Response, bool]:
        try:
            conn.writer.write(payload)
            return await _read_response(conn.reader, method, self.max_body_bytes)
        except BaseException:
            conn.close()
            raise

    async def _connection(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return await self._connect(origin)

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)
        except OSError as e:
            raise HttpError(f"cannot connect: {e}") from None
        if scheme == "https":
            try:
                await writer.start_tls(self._tls(), server_hostname=host)
            except ssl.SSLCertVerificationError as e:
                writer.close()
                reason = e.verify_message
                raise HttpError(
                    f"TLS: the server's certificate is not accepted: {reason}"
                ) from None
            except (OSError, EOFError) as e:  # ssl.SSLError is an OSError
                writer.close()
                reason = str(e) or type(e).__name__
                raise HttpError(f"TLS handshake failed: {reason}") from None
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


async def _read_response(
    reader: asyncio.StreamReader, method: str, max_body: int
) -> tuple[Response, bool]:
    """The final answer, and whether the connection may be used again."""
    try:
        head = parse_head(await reader.readuntil(b"\r\n\r\n"))
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise HttpError("the connection closed in the middle of the answer") from None
        raise _Unanswered("the connection closed before an answer") from None
    except ConnectionError as e:
        raise _Unanswered(f"the connection was reset before an answer: {e}") from None
    except ssl.SSLError as e:
        raise HttpError(f"TLS failed before an answer: {e}") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"the answer's head is over {MAX_HEAD_BYTES} bytes") from None
    try:
        for _ in range(MAX_INTERIM):
            if head.status >= 200:
                break
            if head.status == 101:
                raise HttpError("101 Switching Protocols to a request that asked for no upgrade")
            head = parse_head(await _line(reader, b"\r\n\r\n", "head"))
        else:
            raise HttpError(f"more than {MAX_INTERIM} 1xx answers before the final one")
        frame = framing(head, method, max_body)
        if frame.body is Body.LENGTH:
            body = await reader.readexactly(frame.length)
        elif frame.body is Body.NONE:
            body = b""
        elif frame.body is Body.CHUNKED:
            body = await _chunked(reader, max_body)
        else:
            body = await _to_the_close(reader, max_body)
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed in the middle of the answer") from None
    except (ConnectionError, ssl.SSLError) as e:
        raise HttpError(f"the connection failed in the middle of the answer: {e}") from None
    return Response(head.status, head.headers, body), frame.keep


async def _line(reader: asyncio.StreamReader, end: bytes, what: str) -> bytes:
    try:
        return await reader.readuntil(end)
    except asyncio.LimitOverrunError:
        raise HttpError(f"the answer's {what} is over {MAX_HEAD_BYTES} bytes") from None


async def _chunked(reader: asyncio.StreamReader, max_body: int) -> bytes:
    out = bytearray()
    while True:
        size = chunk_size(await _line(reader, b"\r\n", "chunk size line"))
        if size == 0:
            break
        if len(out) + size > max_body:
            raise HttpError(f"the answer's body is over {max_body} bytes")
        out += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError("a chunk's data is not followed by CRLF")
    trailers = 0
    while (line := await _line(reader, b"\r\n", "trailer section")) != b"\r\n":
        trailers += len(line)
        if trailers > MAX_HEAD_BYTES:
            raise HttpError(f"the answer's trailer section is over {MAX_HEAD_BYTES} bytes")
    return bytes(out)


async def _to_the_close(reader: asyncio.StreamReader, max_body: int) -> bytes:
    out = bytearray()
    while data := await reader.read(_READ_BYTES):
        if len(out) + len(data) > max_body:
            raise HttpError(f"the answer's body is over {max_body} bytes")
        out += data
    return bytes(out)
