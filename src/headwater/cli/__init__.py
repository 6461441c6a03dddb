"""The ``headwater`` command line."""
