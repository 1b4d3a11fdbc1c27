"""Every ```python block of README.md and docs/*.md runs as written, offline, on the CPU.

Each block runs in a fresh namespace (it makes its own imports and inputs), in a temporary working
directory; a variant or class it registers with attnzoo is unregistered afterwards. The line before
a block (blank lines aside) may hold a marker that changes this (docs/development.md):

    <!-- docs-test: continue -->       the block goes on from the one above it on the same page: both
                                       run, in order, in one namespace, as one case
    <!-- docs-test: skip, REASON -->   not run (it needs a GPU, a download, ...): reported as skipped
                                       with REASON
    <!-- docs-test: interpreter -->    runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1
                                       (`make test` sets it), skipped with that reason otherwise
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import attnzoo
from attnzoo.ops import dispatch

from .common import INTERPRET

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(?:,\s*(.*?))?\s*-->")
INTERPRETER_REASON = ("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 set before attnzoo "
                      "is imported (`make test` sets it)")


@dataclass
class Case:
    page: str
    line: int                          # the first block's opening fence, 1-based
    blocks: list = field(default_factory=list)   # (line of the first code line, code)
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def cases() -> list[Case]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        rel = str(page.relative_to(ROOT))
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```python":
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            code = "\n".join(lines[i + 1:end]) + "\n"
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            marker = MARKER.search(before)
            kind, note = (marker.group(1), marker.group(2)) if marker else (None, None)
            if kind == "continue":
                assert found and found[-1].page == rel, f"{rel}:{i + 1}: 'continue' with no block above it"
                found[-1].blocks.append((i + 2, code))
            else:
                case = Case(rel, i + 1, [(i + 2, code)])
                if kind == "skip":
                    assert note, f"{rel}:{i + 1}: a skipped block must say why: <!-- docs-test: skip, REASON -->"
                    case.skip = note
                elif kind == "interpreter":
                    case.skip = None if INTERPRET else INTERPRETER_REASON
                else:
                    assert kind is None, f"{rel}:{i + 1}: unknown marker {before.strip()!r}"
                found.append(case)
            i = end + 1
    return found


CASES = cases()


def test_the_blocks_are_found():
    # an extractor that found nothing would pass every case below
    assert len(CASES) >= 10
    assert any(c.page == "README.md" for c in CASES)


@pytest.fixture
def clean_registry(tmp_path, monkeypatch, one_thread):
    """The block runs in a scratch folder, on one thread (small shapes); what it registers is
    unregistered and the default backend must be as it was."""
    monkeypatch.chdir(tmp_path)
    names, backend = set(attnzoo.available()), dispatch.default_backend()
    yield
    for name in set(attnzoo.available()) - names:
        attnzoo.unregister(name)
    assert dispatch.default_backend() == backend, "a block changed the default backend"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_block_runs(case, clean_registry):
    if case.skip:
        pytest.skip(f"{case.id}: {case.skip}")
    namespace = {"__name__": "__docs__"}
    for first_line, code in case.blocks:
        # padded so that a traceback's line numbers are the page's
        exec(compile("\n" * (first_line - 1) + code, case.page, "exec"), namespace)
