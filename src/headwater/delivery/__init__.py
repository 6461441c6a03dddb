"""HTTP delivery (seed 001): events delivered in batches to HTTP APIs, grouped into
sessions, one request in flight per session, with retries, 413 splits and idempotency keys."""
