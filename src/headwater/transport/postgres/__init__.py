"""PostgreSQL change data capture: a logical replication slot with ``pgoutput``."""
