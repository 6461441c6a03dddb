"""headwater: collect events, keep them on a durable log, process them on Spark, deliver them."""

__version__ = "0.1.0"
