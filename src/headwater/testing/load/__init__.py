"""Load clients, shared by the benchmarks (``bench/``) and the tests. The collector's send
pre-built Raccoon requests over a bare asyncio transport (a distinct ``req_guid`` spliced in
per request), so the load they put on the machine's cores stays small, and count the acks and
their latencies in a window (``Stats``).

- ``requests``: the request template, request ids, response matching, ``Stats``;
- ``websocket``: ``WsClient`` (RFC 6455, requests in flight per connection, closed loop or
  paced), ``open_websockets``, ``pace``;
- ``http1``: ``HttpClient``, a keep-alive HTTP/1.1 client with one POST in flight, and
  ``post_concurrently``, any bodies POSTed by concurrent workers over one aiohttp session;
- ``grpc``: ``GrpcConnection``, unary gRPC calls over one HTTP/2 connection.

The clients for single exchanges and malformed input are in ``headwater.testing.clients``.
"""
