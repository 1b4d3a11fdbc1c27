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

This is not part of ``make test``: it needs a transformers source tree matching the installed
transformers (a git checkout at the installed version's tag; the PyPI sdist lacks tests/models/),
and transformers' test dependencies (pytest, parameterized). Run the same selection both ways:

    PYTHONPATH=$PWD python benchmarks/hf_common_tests.py --tree ~/src/transformers --attention sdpa -k "not slow"
    PYTHONPATH=$PWD python benchmarks/hf_common_tests.py --tree ~/src/transformers --attention attnzoo -k "not slow"

(``--tree`` defaults to $TRANSFORMERS_SOURCE.) Arguments after the known ones go to pytest (not
pytest-xdist's ``-n``: the route is a plugin of this one process). With ``--json FILE`` the
per-architecture counts are written there too.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import sys

ARCHITECTURES = ("gemma2", "gpt_oss", "mistral", "qwen2")


def model_test_files(tree: str, architectures) -> list[str]:
    files = [os.path.join(tree, "tests", "models", a, f"test_modeling_{a}.py") for a in architectures]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"--tree {tree!r}: no {', '.join(missing)}; give the root of a transformers source "
                         "tree (a git checkout at the installed version), not the PyPI sdist")
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
    parser.add_argument("--tree", default=os.environ.get("TRANSFORMERS_SOURCE"),
                        help="root of a transformers source tree (default: $TRANSFORMERS_SOURCE)")
    parser.add_argument("--attention", choices=("attnzoo", "sdpa"), default="attnzoo")
    parser.add_argument("--models", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES))
    parser.add_argument("--json", help="write the per-architecture counts to this file")
    args, pytest_args = parser.parse_known_args(argv)
    if not args.tree:
        parser.error("--tree (or $TRANSFORMERS_SOURCE) is required: the root of a transformers source tree")
    if any(a == "-n" or a.startswith(("-n=", "--numprocesses", "--dist")) for a in pytest_args):
        # pytest-xdist's workers would load neither the route nor the counter
        parser.error("the tests run in this one process (the route to attnzoo is this process's plugin): drop -n")
    import pytest
    files = model_test_files(os.path.abspath(args.tree), args.models)
    report = os.path.abspath(args.json) if args.json else None
    route = AttentionRoute(args.attention, args.models)
    # transformers' tests import each other as the package `tests`: run from the tree's root so that
    # its `tests` is the one found (never attnzoo's own)
    os.chdir(os.path.abspath(args.tree))
    sys.path.insert(0, os.getcwd())
    code = pytest.main(["-p", "no:cacheprovider", *pytest_args, *files], plugins=[route])
    if report:
        with open(report, "w") as f:
            json.dump({"attention": args.attention, "pytest_args": pytest_args, "exit_code": int(code),
                       "architectures": route.summary()}, f, indent=1)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
