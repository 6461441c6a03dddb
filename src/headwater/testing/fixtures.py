"""pytest fixtures for the real services headwater's tests use (registered as a pytest plugin)."""
