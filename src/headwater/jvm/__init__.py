"""JVM artifacts (Maven) for Spark and the test broker."""
