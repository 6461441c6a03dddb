"""The Kafka reader: topics of an external Kafka cluster (not the bus) onto the log."""
