"""The collector, independent of the server it runs in: every intake's request handling.

The HTTP/WebSocket server and the gRPC server only move bytes; this module decides what each
request means, who sent it, where its events go and what the client is told.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from headwater.bus.base import Bus
from headwater.collector.admission import Admission, NoticedAdmission
from headwater.collector.auth import WriteKeys, key_from_headers
from headwater.collector.config import CollectorConfig, LimitsConfig
from headwater.collector.dedup import RecentRequests
from headwater.collector.errors import Rejected, bad_request, unauthorized
from headwater.collector.events import Intake, RequestContext
from headwater.collector.limits import Connections
from headwater.collector.link import Link
from headwater.collector.metrics import Metrics
from headwater.collector.protocols import jitsu, otlp, raccoon, segment
from headwater.collector.protocols.body import decode_body
from headwater.collector.publisher import Publisher
from headwater.collector.routing import Router
from headwater.webhooks.intake import WebhookIntake
from headwater.webhooks.intake import to_body as webhook_body

log = logging.getLogger(__name__)

RACCOON_SOURCE = "raccoon"
SEGMENT_CALLS = frozenset({"batch", "track", "identify", "page", "screen", "group", "alias"})
JSON = "application/json"
INLINE_DECODE_BYTES = 64 * 1024  # larger bodies are decoded in a worker thread


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # lowercase names
    body: bytes
    peer: str
    query: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = JSON
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class Connection:
    """One Raccoon WebSocket connection: who it is, and the requests it recently sent."""

    identity: str
    source: str
    client_ip: str
    user_agent: str
    # the req_guids it sent recently (small for the thousands of idle connections a server holds)
    recent: RecentRequests = field(default_factory=RecentRequests)


class Collector:
    """Every intake's request handling, on a bus open in this process, or, in an intake worker,
    through its ``link`` to the process that holds the log (``bus`` None: the embedded log
    there; a Kafka bus: this worker's own producer). With a link, connection limits, admission
    and readiness are the holding process's, and ``/metrics`` sums every worker's."""

    def __init__(
        self,
        config: CollectorConfig,
        bus: Bus | None,
        *,
        max_record_bytes: int,
        log_dir: object = None,
        link: Link | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.link = link
        self.metrics = metrics or Metrics()
        self.keys = WriteKeys(config.sources)
        self.connections = Connections(
            config.raccoon.max_connections, config.raccoon.max_connections_per_identity
        )
        self.admission = (
            NoticedAdmission(config.admission, link.notice)
            if link is not None
            else Admission(bus, config.admission, log_dir)  # type: ignore[arg-type]
        )
        self.publisher = Publisher(
            bus,
            durable=config.ack == "durable",
            max_record_bytes=max_record_bytes,
            admission=self.admission,
            metrics=self.metrics,
            retry_after_s=config.admission.retry_after_s,
            sink=link if link is not None and bus is None else None,
        )
        self.raccoon_router = Router(config.raccoon.topic_pattern)
        self.json_router = Router(config.topic_pattern)
        self._source_routers = {
            s.id: Router(s.topic_pattern) for s in config.sources if s.topic_pattern
        }
        self._trusted = [ipaddress.ip_network(n, strict=False) for n in config.trusted_proxies]
        self.ready = False
        self.draining = False
        # The webhook intake (``POST /webhooks/{source}``), when webhooks are configured.
        self.webhooks: WebhookIntake | None = None
        # What else must be healthy for /readyz (``headwater up``: the pipeline's destinations):
        # returns the failing parts and why, empty when all is well.
        self.readiness: Callable[[], dict[str, str] | Awaitable[dict[str, str]]] | None = None
        if link is not None:
            self.readiness = lambda: link.call("ready")

    # -- context ----------------------------------------------------------------------------
    def client_ip(self, peer: str, headers: Mapping[str, str]) -> str:
        """The client's address: the peer, or, when the peer is a trusted proxy, the nearest
        untrusted address in X-Forwarded-For."""
        if not self._trusted or not self._is_trusted(peer):
            return peer
        forwarded = [a.strip() for a in headers.get("x-forwarded-for", "").split(",") if a.strip()]
        for address in reversed(forwarded):
            if not self._is_trusted(address):
                return address
        return forwarded[0] if forwarded else peer

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._trusted)

    def _context(
        self, protocol: str, source: str, request_id: str | None, client_ip: str, user_agent: str
    ) -> RequestContext:
        return RequestContext(
            protocol,
            source,
            request_id or str(uuid.uuid4()),
            time.time_ns() // 1_000_000,
            client_ip,
            user_agent,
        )

    def raccoon_source(self, headers: Mapping[str, str]) -> str:
        """The source of a Raccoon request: "raccoon" when open, the key's owner when keyed."""
        if self.config.raccoon.auth == "open":
            return RACCOON_SOURCE
        return self.keys.source_for(key_from_headers(headers))

    def refused(self, e: Rejected, protocol: str, request_id: str | None, client: str) -> None:
        """Count and log a refusal (with the request id, for tracing a client's complaint)."""
        self.metrics.rejected(e.kind)
        log.info(
            "refused a request: %s",
            e.reason,
            extra={
                "request_id": request_id or "",
                "protocol": protocol,
                "kind": e.kind,
                "client_ip": client,
            },
        )

    async def _publish(self, intake: Intake, ctx: RequestContext, router: Router) -> None:
        if len(intake.events) > self.config.limits.max_batch_events:
            raise bad_request(
                f"the request has {len(intake.events)} events; the limit is "
                f"{self.config.limits.max_batch_events} (collector.limits.max_batch_events)",
                kind="too_many_events",
            )
        started = time.perf_counter()
        await self.publisher.publish(intake.events, ctx, router)
        self.metrics.acked(ctx.protocol, time.perf_counter() - started)

    # -- Raccoon over WebSocket -------------------------------------------------------------
    async def open_connection(self, headers: Mapping[str, str], peer: str) -> Connection:
        """Admit a WebSocket connection, or raise ``Rejected`` (limits, auth, draining)."""
        if self.draining:
            raise Rejected(
                "the collector is shutting down", status=503, retry_after=1, kind="shutting_down"
            )
        cfg = self.config.raccoon
        identity = headers.get(cfg.identity_header.lower(), "")
        if not identity:
            raise bad_request(f"the {cfg.identity_header} header is required", kind="no_identity")
        if cfg.group_header:
            identity = f"{identity}\x00{headers.get(cfg.group_header.lower(), '')}"
        source = self.raccoon_source(headers)
        if self.link is not None:
            await self.link.open_connection(identity)
        else:
            self.connections.open(identity)
        self.metrics.connections.inc()
        return Connection(
            identity,
            source,
            self.client_ip(peer, headers),
            sys.intern(headers.get("user-agent", "")),  # (thousands of clients share a few)
        )

    def close_connection(self, conn: Connection) -> None:
        if self.link is not None:
            self.link.close_connection(conn.identity)
        else:
            self.connections.close(conn.identity)
        self.metrics.connections.dec()

    async def raccoon_message(self, conn: Connection, data: bytes | str) -> bytes | str:
        """Handle one WebSocket message (binary: protobuf; text: JSON) and return the response
        in the same encoding. A repeated ``req_guid`` on the connection is not published again:
        it gets the first one's outcome."""
        as_json = isinstance(data, str)
        encode_ok = raccoon.ok_response_json if as_json else raccoon.ok_response_bytes
        encode_error = raccoon.error_response_json if as_json else raccoon.error_response_bytes
        req_guid = ""
        try:
            intake = (
                raccoon.decode_request_json(data, self.config.limits)
                if as_json
                else raccoon.decode_request(data, self.config.limits)  # type: ignore[arg-type]
            )
            req_guid = intake.request_id or ""
            await self._once(
                conn,
                req_guid,
                lambda: self._publish(
                    intake,
                    self._context(
                        "raccoon-ws", conn.source, req_guid, conn.client_ip, conn.user_agent
                    ),
                    self.raccoon_router,
                ),
            )
        except Rejected as e:
            self.refused(e, "raccoon-ws", req_guid, conn.client_ip)
            return encode_error(e, req_guid or None)
        return encode_ok(req_guid)

    async def _once(
        self, conn: Connection, req_guid: str, publish: Callable[[], Awaitable[None]]
    ) -> None:
        window = self.config.raccoon.dedup_window
        if not req_guid or not window:
            await publish()
            return
        recent = conn.recent
        earlier = recent.running(req_guid)
        if earlier is not None or recent.stored(req_guid):
            self.metrics.rejected("duplicate_request")
            if earlier is not None:
                await asyncio.shield(earlier)  # the first attempt's outcome is this one's
            return
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        recent.start(req_guid, outcome)
        try:
            await publish()
        except BaseException as e:
            recent.end(req_guid, stored=False, window=window)
            outcome.set_exception(e)
            outcome.exception()  # retrieved: nobody else may be waiting
            raise
        recent.end(req_guid, stored=True, window=window)
        outcome.set_result(None)

    # -- Raccoon over gRPC ------------------------------------------------------------------
    async def raccoon_grpc(self, data: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        req_guid = ""
        try:
            source = self.raccoon_source(metadata)
            intake = raccoon.decode_request(data, self.config.limits)
            req_guid = intake.request_id or ""
            ctx = self._context(
                "raccoon-grpc",
                source,
                req_guid,
                self.client_ip(peer, metadata),
                metadata.get("user-agent", ""),
            )
            await self._publish(intake, ctx, self.raccoon_router)
        except Rejected as e:
            self.refused(e, "raccoon-grpc", req_guid, peer)
            return raccoon.error_response_bytes(e, req_guid or None)
        return raccoon.ok_response_bytes(req_guid)

    # -- HTTP -------------------------------------------------------------------------------
    async def http(self, req: HttpRequest) -> HttpResponse:
        """Every plain HTTP route of the collector."""
        if self.webhooks is not None:
            route = self.webhooks.route(req.method, req.path)
            if route is not None:
                return await self._webhook(req, *route)
        if req.method == "GET":
            return await self._get(req.path)
        if req.method == "OPTIONS":  # a browser SDK's preflight
            return HttpResponse(204, b"", "text/plain", _cors(req, preflight=True))
        if req.method != "POST":
            return _plain(405, f"{req.method} is not allowed on {req.path}")
        path = req.path.rstrip("/") or "/"
        if path == "/api/v1/events":
            return await self._raccoon_rest(req)
        if path.startswith("/v1/") and path[4:] in SEGMENT_CALLS:
            return await self._json_api(req, "segment", path[4:])
        if path.startswith("/api/s/") and len(path) > 7:
            return await self._json_api(req, "jitsu", path[7:].removeprefix("s2s/"))
        if path == "/api/v1/event":
            return await self._json_api(req, "jitsu-classic", "")
        if path == "/v1/logs":
            return await self._json_api(req, "otlp", "")
        return _plain(404, f"no such endpoint: POST {req.path}")

    async def _webhook(
        self, req: HttpRequest, method: str, source_id: str, message_id: str | None
    ) -> HttpResponse:
        intake = self.webhooks
        assert intake is not None
        headers: list[tuple[str, str]] = []
        try:
            intake.authorize(source_id, req.headers, req.query)
            if message_id is not None:
                status, doc = intake.status(source_id, message_id)
            else:
                body = decode_body(
                    req.body,
                    req.headers.get("content-encoding"),
                    self.config.limits.max_body_bytes,
                )
                base = f"http://{req.headers.get('host', 'localhost')}"
                status, doc = await intake.post(source_id, body, req.headers, base)
                if status == 202:
                    headers.append(("location", doc["status_url"]))
        except Rejected as e:
            self.refused(e, "webhooks", None, req.peer)
            status, doc = e.status, {"error": e.reason}
            if e.retry_after is not None:
                headers.append(("retry-after", str(e.retry_after)))
        return HttpResponse(status, webhook_body(doc), JSON, headers)

    async def _get(self, path: str) -> HttpResponse:
        if path == "/healthz":
            return _plain(200 if self.ready else 503, "ok" if self.ready else "starting")
        if path == "/readyz":
            if not self.ready or self.draining:
                return _plain(503, "draining" if self.draining else "starting")
            if self.admission.refusal:
                return _plain(503, self.admission.refusal)
            failing = self.readiness() if self.readiness is not None else {}
            if not isinstance(failing, dict):
                failing = await failing
            if failing:
                body = json.dumps({"ready": False, "failing": failing}).encode() + b"\n"
                return HttpResponse(503, body, JSON)
            return _plain(200, "ready")
        if path == "/metrics":
            if self.link is not None:  # every worker's, summed where the log is held
                text = (await self.link.call("metrics")).encode()
            else:
                text = self.metrics.render()
            return HttpResponse(200, text, "text/plain; version=0.0.4")
        return _plain(404, f"no such endpoint: GET {path}")

    async def _raccoon_rest(self, req: HttpRequest) -> HttpResponse:
        media = req.headers.get("content-type", "").split(";")[0].strip().lower()
        as_json = media == JSON
        req_guid = ""
        try:
            if media not in (
                JSON,
                "application/proto",
                "application/x-protobuf",
                "application/protobuf",
                "application/octet-stream",
            ):
                raise Rejected(
                    f"content type {media or '(none)'!r} is not accepted: send "
                    "application/proto or application/json",
                    status=415,
                    kind="content_type",
                )
            body = decode_body(
                req.body, req.headers.get("content-encoding"), self.config.limits.max_body_bytes
            )
            source = self.raccoon_source(req.headers)
            intake = (
                raccoon.decode_request_json(body, self.config.limits)
                if as_json
                else raccoon.decode_request(body, self.config.limits)
            )
            req_guid = intake.request_id or ""
            ctx = self._context(
                "raccoon-rest",
                source,
                req_guid,
                self.client_ip(req.peer, req.headers),
                req.headers.get("user-agent", ""),
            )
            await self._publish(intake, ctx, self.raccoon_router)
        except Rejected as e:
            self.refused(e, "raccoon-rest", req_guid, req.peer)
            body_out = (
                raccoon.error_response_json(e, req_guid or None).encode()
                if as_json
                else raccoon.error_response_bytes(e, req_guid or None)
            )
            return _with_retry(
                HttpResponse(e.status, body_out, JSON if as_json else "application/proto"), e
            )
        if as_json:
            return HttpResponse(200, raccoon.ok_response_json(req_guid).encode(), JSON)
        return HttpResponse(200, raccoon.ok_response_bytes(req_guid), "application/proto")

    async def _json_api(self, req: HttpRequest, api: str, arg: str) -> HttpResponse:
        limits = self.config.limits
        media = req.headers.get("content-type", "").split(";")[0].strip().lower()
        cors = _cors(req, preflight=False)
        try:
            if len(req.body) > INLINE_DECODE_BYTES:  # big bodies: keep the event loop serving
                intake = await asyncio.to_thread(_decode_json_api, api, arg, req, media, limits)
            else:
                intake = _decode_json_api(api, arg, req, media, limits)
            header_key = key_from_headers(req.headers, req.query)
            body_key = intake.meta.get("write_key")
            if header_key and body_key and header_key != body_key:
                raise unauthorized("the request carries two different write keys")
            source = self.keys.source_for(header_key or body_key)
            if intake.events or api != "otlp":  # an empty OTLP export is valid: nothing to store
                ctx = self._context(
                    api.split("-")[0],
                    source,
                    intake.request_id,
                    self.client_ip(req.peer, req.headers),
                    req.headers.get("user-agent", ""),
                )
                router = self._source_routers.get(source, self.json_router)
                await self._publish(intake, ctx, router)
        except Rejected as e:
            self.refused(e, api, None, req.peer)
            resp = _with_retry(_json_error(api, media, e), e)
        else:
            resp = _json_ok(api, media)
        resp.headers += cors
        return resp


def _decode_json_api(
    api: str, arg: str, req: HttpRequest, media: str, limits: LimitsConfig
) -> Intake:
    body = decode_body(req.body, req.headers.get("content-encoding"), limits.max_body_bytes)
    if api == "segment":
        return segment.decode_segment(arg, body, limits)
    if api == "jitsu":
        return jitsu.decode_jitsu_typed(arg, body, limits)
    if api == "jitsu-classic":
        return jitsu.decode_jitsu_classic(body, limits)
    return otlp.decode_otlp_logs(body, media, limits)


def _cors(req: HttpRequest, *, preflight: bool) -> list[tuple[str, str]]:
    """CORS headers for browser SDKs (analytics.js, Jitsu's JS): any origin may send events;
    write keys, not origins, decide who is let in."""
    origin = req.headers.get("origin")
    if not origin:
        return []
    headers = [("access-control-allow-origin", origin), ("vary", "Origin")]
    if preflight:
        headers += [
            ("access-control-allow-methods", "POST, OPTIONS"),
            (
                "access-control-allow-headers",
                "Content-Type, Content-Encoding, Authorization, X-Write-Key, X-Auth-Token",
            ),
            ("access-control-max-age", "86400"),
        ]
    return headers


def _json_ok(api: str, media: str) -> HttpResponse:
    if api == "otlp":
        body, content_type = otlp.encode_otlp_response(media)
        return HttpResponse(200, body, content_type)
    if api == "jitsu":
        return HttpResponse(200, jitsu.TYPED_SUCCESS_BODY)
    if api == "jitsu-classic":
        return HttpResponse(200, jitsu.CLASSIC_SUCCESS_BODY)
    return HttpResponse(200, segment.SUCCESS_BODY)


def _json_error(api: str, media: str, e: Rejected) -> HttpResponse:
    if api == "otlp":
        body, content_type = otlp.encode_otlp_status(media, e)
        return HttpResponse(e.status, body, content_type)
    if api.startswith("jitsu"):
        return HttpResponse(e.status, jitsu.error_body(e))
    return HttpResponse(e.status, segment.error_body(e))


def _with_retry(resp: HttpResponse, e: Rejected) -> HttpResponse:
    if e.retry_after is not None:
        resp.headers.append(("retry-after", str(e.retry_after)))
    return resp


def _plain(status: int, text: str) -> HttpResponse:
    return HttpResponse(status, text.encode() + b"\n", "text/plain; charset=utf-8")
