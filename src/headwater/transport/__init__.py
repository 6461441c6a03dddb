"""Transport (seed 003): readers that bring other systems' data onto the log, and the
writers' functions and apply modes. Being built: see docs/transport.md."""
