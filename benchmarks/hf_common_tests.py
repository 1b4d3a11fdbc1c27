"""transformers' own shared model tests with attnzoo's softmax as the attention implementation.

Runs tests/models/{gemma2,gpt_oss,mistral,qwen2}/test_modeling_*.py of a transformers source tree
(its tests/test_modeling_common.py is what they share) in one pytest session, either as transformers
runs them (``--attention sdpa``, the baseline) or with attnzoo (``--attention attnzoo``, the default):

* the "sdpa" entries of transformers' AttentionInterface and AttentionMaskInterface become what
  ``attnzoo.adapters.hf.register_hf_attention("softmax")`` registers as "attnzoo_softmax" (the
  attention function and its mask function), so every model a test builds with the default
  implementation, or with attn_implementation="sdpa", runs attnzoo; tests that compare "eager"
  with "sdpa" compare transformers' eager attention with attnzoo's;
* Gemma 2 and gpt-oss declare ``_supports_sdpa = False`` (torch's SDPA has no logit softcapping and
  no attention sinks), so their models would default to eager and never reach "sdpa": in the attnzoo
  run their PreTrainedModel classes claim SDPA, so their default is attnzoo (which has both);
* every call of the attention function that "sdpa" names is counted, and the summary says how many
  tests called it and how often, per architecture: the proof that the tests ran attnzoo (in the
  baseline the same count is of torch's SDPA).

The tests come from one of two places:

* ``--sdist`` (the default without ``--tree``): the PyPI sdist of the installed transformers version,
  fetched with ``pip download --no-deps --no-binary :all: transformers==<version>`` into a cache
  directory (or ``--sdist PATH``: a tarball already downloaded). Its tests/test_modeling_common.py and
  tests/test_training_mixin.py go into a temporary tree beside attnzoo's own model testers
  (benchmarks/hf_common/: the sdist has no tests/models/);
* ``--tree DIR`` (default $TRANSFORMERS_SOURCE): a transformers source tree at the installed version
  (a git checkout), whose own tests/models/ are run.

With ``--sdist``, ``--sliding-window W`` gives every model of attnzoo's testers a sliding window of W
tokens (their configs' own windows never bind at the testers' 7 tokens).

This is not part of ``make test``: it needs the network (or a downloaded sdist) and transformers' test
dependency ``parameterized``. Run the same selection both ways:

    PYTHONPATH=$PWD python benchmarks/hf_common_tests.py --attention sdpa -k "not slow"
    PYTHONPATH=$PWD python benchmarks/hf_common_tests.py --attention attnzoo -k "not slow"
 Arguments after the known ones go to pytest (not
pytest-xdist's ``-n``: the route is a plugin of this one process). With ``--json FILE`` the
per-architecture counts are written there too.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from hf_common import ARCHITECTURES, FROM_SDIST, HERE as TESTERS, LAYOUT, WINDOW

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnzoo" / "transformers-sdist"


def download_command(version: str, into) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"transformers=={version}", "-d", str(into)]


def fetch_sdist(version: str, cache=CACHE) -> Path:
    """The sdist of transformers `version` in `cache`, downloaded there by pip unless it already is."""
    cache = Path(cache)
    found = sorted(cache.glob(f"transformers-{version}.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    command = download_command(version, cache)
    done = subprocess.run(command, capture_output=True, text=True)
    found = sorted(cache.glob(f"transformers-{version}.tar.gz"))
    if done.returncode or not found:
        raise SystemExit(f"could not fetch transformers {version}'s sdist (offline?): `{' '.join(command)}` "
                         f"failed:\n{(done.stderr or done.stdout).strip()[-2000:]}\n"
                         "download it elsewhere and pass --sdist PATH, or give --tree a transformers checkout")
    return found[0]


def sdist_tree(sdist, version: str, into) -> Path:
    """A tree at `into`: the sdist's shared test files (FROM_SDIST) and attnzoo's model testers
    (benchmarks/hf_common, per LAYOUT), each test directory a package as transformers' tests/ is."""
    sdist, root = Path(sdist), Path(into)
    if not sdist.is_file():
        raise SystemExit(f"--sdist {str(sdist)!r}: no such file; give transformers-{version}.tar.gz "
                         "(or no path, to download it)")
    prefix = f"transformers-{version}/"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        missing = [f for f in FROM_SDIST if prefix + f not in names]
        if missing:
            top = sorted({n.split("/")[0] for n in names})
            raise SystemExit(f"--sdist {str(sdist)!r} has no {', '.join(prefix + f for f in missing)}: "
                             f"it must be the sdist of the installed transformers {version} (it holds {top})")
        for f in FROM_SDIST:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_bytes(tar.extractfile(prefix + f).read())
    for source, places in LAYOUT.items():
        for place in (places,) if isinstance(places, str) else places:
            (root / place).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(TESTERS / source, root / place)
    for directory in [root / "tests", *(root / "tests").rglob("*")]:
        if directory.is_dir():
            (directory / "__init__.py").touch()
    return root


def model_test_files(tree: str, architectures) -> list[str]:
    files = [os.path.join(tree, "tests", "models", a, f"test_modeling_{a}.py") for a in architectures]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"--tree {tree!r}: no {', '.join(missing)}; give the root of a transformers source "
                         "tree (a git checkout at the installed version), or use --sdist")
    return files


def _architecture(nodeid: str) -> str:
    parts = nodeid.replace("\\", "/").split("/")
    return parts[parts.index("models") + 1] if "models" in parts[:-1] else "?"


class AttentionRoute:
    """A pytest plugin: points "sdpa" at attnzoo (or leaves it) and counts its calls per test."""

    def __init__(self, attention: str, architectures):
        self.attention, self.architectures = attention, tuple(architectures)
        self.calls = 0
        self.outcomes = collections.defaultdict(collections.Counter)   # architecture -> outcome -> count
        self.calls_by = collections.defaultdict(collections.Counter)   # architecture -> {"tests", "calls"}
        self._before = {}
        self._undo = []   # (mapping or class, key, previous value): what pytest_unconfigure puts back

    def _set(self, where, key: str, value) -> None:
        if isinstance(where, dict):
            self._undo.append((where, key, where[key]))
            where[key] = value
        else:
            self._undo.append((where, key, where.__dict__[key]))
            setattr(where, key, value)

    def pytest_configure(self, config):
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
        if self.attention == "attnzoo":
            from attnzoo.adapters.hf import register_hf_attention
            register_hf_attention("softmax")
            function = AttentionInterface._global_mapping["attnzoo_softmax"]
            masks = AttentionMaskInterface._global_mapping
            self._set(masks, "sdpa", masks["attnzoo_softmax"])
            self._claim_sdpa()
        else:
            function = AttentionInterface._global_mapping["sdpa"]

        def counted(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)
        counted.__name__ = getattr(function, "__name__", "attention")
        self._set(AttentionInterface._global_mapping, "sdpa", counted)

    def pytest_unconfigure(self, config):
        while self._undo:
            where, key, value = self._undo.pop()
            if isinstance(where, dict):
                where[key] = value
            else:
                setattr(where, key, value)

    def _claim_sdpa(self) -> None:
        """Gemma 2's and gpt-oss's models turn SDPA off for what torch's SDPA lacks (softcap, sinks),
        which attnzoo's softmax has: let them default to "sdpa", here attnzoo."""
        from transformers import PreTrainedModel
        for a in self.architectures:
            module = importlib.import_module(f"transformers.models.{a}.modeling_{a}")
            for value in vars(module).values():
                if (isinstance(value, type) and issubclass(value, PreTrainedModel)
                        and value.__dict__.get("_supports_sdpa") is False):
                    self._set(value, "_supports_sdpa", True)

    def pytest_runtest_setup(self, item):
        self._before[item.nodeid] = self.calls

    def pytest_runtest_logreport(self, report):
        if type(report).__name__ != "TestReport":   # a subtest's report: counted within its test
            return
        arch = _architecture(report.nodeid)
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[arch][report.outcome] += 1
        if report.when == "teardown":
            made = self.calls - self._before.pop(report.nodeid, self.calls)
            if made:
                self.calls_by[arch]["tests"] += 1
                self.calls_by[arch]["calls"] += made

    def summary(self) -> dict:
        return {a: {**{k: self.outcomes[a][k] for k in ("passed", "failed", "skipped")},
                    "tests_calling_attention": self.calls_by[a]["tests"],
                    "attention_calls": self.calls_by[a]["calls"]}
                for a in sorted(self.outcomes)}

    def pytest_terminal_summary(self, terminalreporter):
        named = "attnzoo softmax (as \"sdpa\")" if self.attention == "attnzoo" else "torch SDPA"
        terminalreporter.section(f"attention: {named}")
        for a, row in self.summary().items():
            terminalreporter.write_line(
                f"{a}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped; "
                f"{named} called {row['attention_calls']} times in {row['tests_calling_attention']} tests")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--tree", default=os.environ.get("TRANSFORMERS_SOURCE"),
                       help="root of a transformers source tree (default: $TRANSFORMERS_SOURCE)")
    where.add_argument("--sdist", nargs="?", const="download", default=None, metavar="PATH",
                       help="the installed version's PyPI sdist (the default without --tree): downloaded "
                            f"into {CACHE} without PATH, or the tarball at PATH")
    parser.add_argument("--attention", choices=("attnzoo", "sdpa"), default="attnzoo")
    parser.add_argument("--models", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES))
    parser.add_argument("--json", help="write the per-architecture counts to this file")
    parser.add_argument("--sliding-window", type=int, metavar="W",
                        help="with --sdist: attnzoo's testers give every model this sliding window "
                             "(their configs' own never bind at the testers' 7 tokens)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.sdist:
        args.tree = None   # --sdist wins over $TRANSFORMERS_SOURCE
    if any(a == "-n" or a.startswith(("-n=", "--numprocesses", "--dist")) for a in pytest_args):
        # pytest-xdist's workers would load neither the route nor the counter
        parser.error("the tests run in this one process (the route to attnzoo is this process's plugin): drop -n")
    import importlib.util

    import transformers
    if importlib.util.find_spec("parameterized") is None:
        raise SystemExit("transformers' test_modeling_common needs `parameterized`: "
                         f"{sys.executable} -m pip install parameterized")
    if args.tree:
        if args.sliding_window:
            parser.error("--sliding-window sets attnzoo's testers (--sdist), not a checkout's")
        return run(os.path.abspath(args.tree), args, pytest_args)
    if args.sliding_window:
        os.environ[WINDOW] = str(args.sliding_window)   # read by benchmarks/hf_common/causal_lm_tester.py
    version = transformers.__version__
    sdist = fetch_sdist(version) if args.sdist in (None, "download") else Path(args.sdist)
    with tempfile.TemporaryDirectory(prefix="attnzoo-hf-common-") as scratch:
        tree = str(sdist_tree(sdist, version, scratch))
        print(f"transformers {version}'s tests from {sdist}, with attnzoo's model testers, in {tree}")
        return run(tree, args, pytest_args)


def run(tree: str, args, pytest_args) -> int:
    """pytest on the tree's model tests, with the route; its counts to args.json."""
    import pytest
    files = model_test_files(tree, args.models)
    report = os.path.abspath(args.json) if args.json else None
    route = AttentionRoute(args.attention, args.models)
    # transformers' tests import each other as the package `tests`: run from the tree's root so that
    # its `tests` is the one found (never attnzoo's own)
    before = os.getcwd()
    os.chdir(tree)
    sys.path.insert(0, tree)
    try:
        code = pytest.main(["-p", "no:cacheprovider", *pytest_args, *files], plugins=[route])
    finally:
        os.chdir(before)   # out of the tree before a temporary one is removed
    if report:
        with open(report, "w") as f:
            json.dump({"attention": args.attention, "pytest_args": pytest_args, "exit_code": int(code),
                       "architectures": route.summary()}, f, indent=1)
    return int(code)

if __name__ == "__main__":
    sys.exit(main())
