"""The postgres destination."""
