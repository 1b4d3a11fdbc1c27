"""``attnzoo <command> ...``: each command is a module in attnzoo/commands/ exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.

A command checks its arguments before it does any work and raises ``UsageError`` for bad ones;
that, and the data / checkpoint errors whose messages say what to do, print as one
``attnzoo COMMAND: error: ...`` line with exit status 2 (argparse's convention), no traceback."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__, commands
from .commands import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description="attention variants behind one interface")
    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        # argparse %-formats a subcommand's help= (for %(default)s and the like) but not its
        # description: a literal % (e.g. "95% CI") must be doubled in the one and not the other
        p = sub.add_parser(info.name.replace("_", "-"), help=mod.HELP.replace("%", "%%"), description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _is_user_error(error: BaseException) -> bool:
    if isinstance(error, UsageError):
        return True
    from .train import CheckpointError, DataNotFoundError
    return isinstance(error, (CheckpointError, DataNotFoundError))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except Exception as e:
        if not _is_user_error(e):
            raise
        print(f"attnzoo {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
