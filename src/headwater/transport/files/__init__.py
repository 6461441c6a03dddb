"""The files reader: a directory of JSON lines, CSV or Parquet files onto the log."""
