"""Error types that map to the CLI's exit codes (2 = bad input, 1 = run-time failure)."""


class UsageError(Exception):
    """Bad input: config, data, checkpoint or CLI arguments. The CLI prints one line and exits 2.

    The message must name the offending field or file.
    """


class RunFailure(Exception):
    """A failure at run time that is not the user's input. The CLI prints one line and exits 1."""
