"""What operators look at, shared by the command line (``headwater.cli``) and the console
(``headwater.console``): writer lag, log records for people, the warehouse read without blocking
the writer, configuration with its secrets masked, and the errors of bad operator input."""
