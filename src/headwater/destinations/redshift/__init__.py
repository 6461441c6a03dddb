"""The redshift destination."""
