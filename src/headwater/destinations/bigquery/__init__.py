"""The bigquery destination."""
