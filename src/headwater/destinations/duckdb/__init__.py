"""The duckdb destination."""
