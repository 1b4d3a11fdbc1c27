"""``attnzoo --help`` and every subcommand's ``--help`` print their help and exit 0: through the
console script's entry point in-process (read from pyproject.toml) and through ``python -m attnzoo``
in a fresh interpreter, as a user runs them."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def entry_point():
    """The function behind the ``attnzoo`` console script, as pyproject.toml names it."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    target = re.search(r'^attnzoo\s*=\s*"([\w.]+):(\w+)"', scripts, re.M)
    assert target, "pyproject.toml's [project.scripts] has no attnzoo entry"
    return getattr(importlib.import_module(target.group(1)), target.group(2))


def subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def command_paths(parser=None, prefix=()):
    """Every command and nested subcommand as an argv prefix: ("list",), ("analyze", "lipschitz"), ..."""
    parser = parser or build_parser()
    for name, sub in subparsers(parser).items():
        yield (*prefix, name)
        yield from command_paths(sub, (*prefix, name))


COMMANDS = list(command_paths())
TOP_LEVEL = [c[0] for c in COMMANDS if len(c) == 1]


def test_every_command_is_found():
    # a walker that found nothing would pass everything below
    assert {"list", "bench", "train", "analyze", "demo", "compare"} <= set(TOP_LEVEL)
    assert ("analyze", "lipschitz") in COMMANDS


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_in_process(capsys, flag):
    main = entry_point()
    with pytest.raises(SystemExit) as done:
        main([flag])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnzoo")
    for name in TOP_LEVEL:
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), f"{name} missing from the help:\n{out}"
    assert "95% CI" in out  # compare's help, its % printed as written


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_subcommand_help_in_process(capsys, argv):
    with pytest.raises(SystemExit) as done:
        entry_point()([*argv, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: attnzoo {' '.join(argv)}"), out
    assert "%(" not in out and "%%" not in out, out  # every %-format expanded, no doubled % left


@pytest.mark.parametrize("argv", [["--help"], ["-h"]] + [[c, "--help"] for c in TOP_LEVEL], ids=" ".join)
def test_help_from_a_fresh_interpreter(argv):
    proc = subprocess.run([sys.executable, "-m", "attnzoo", *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: attnzoo") and "Traceback" not in proc.stderr, proc.stderr
