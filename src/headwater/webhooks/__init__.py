"""The webhook transport (seed 004): senders' webhooks carried to receivers and the receivers'
responses carried back, with dedup, status tracking, per-receiver rate limits and retries."""
