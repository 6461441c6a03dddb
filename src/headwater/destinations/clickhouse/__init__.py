"""The clickhouse destination."""
