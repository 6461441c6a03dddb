"""Delta Lake tables (``type: delta``) with delta-rs: tasks write Parquet, the driver commits."""
