"""``attnzoo <command> ...``: each command is a module in attnzoo/commands/ exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description="attention variants behind one interface")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(info.name.replace("_", "-"), help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
