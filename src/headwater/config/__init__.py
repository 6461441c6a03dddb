"""Config: one YAML file validated by pydantic models."""
