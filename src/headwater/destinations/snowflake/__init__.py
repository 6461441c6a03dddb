"""The snowflake destination."""
