"""``attnzoo`` subcommands, one module each (see attnzoo/cli.py)."""


class UsageError(ValueError):
    """Bad command-line input, found before any work: ``attnzoo`` prints it as one ``error:`` line and
    exits with status 2, as argparse does for its own checks."""
