"""The processes users run, assembled from the packages below."""
