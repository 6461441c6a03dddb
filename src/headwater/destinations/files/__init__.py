"""The files destination."""
