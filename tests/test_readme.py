"""The README is a front page: the two set-up commands first, links that resolve, and a benchmark
section that is exactly what benchmarks/render_readme.py makes from the committed result files."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import attnzoo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_two_setup_commands_come_first():
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    assert len(text.splitlines()) <= 150  # a front page; the long sections live in docs/
    makefile = (ROOT / "Makefile").read_text()
    assert "apt-get" not in makefile and "sudo" not in makefile


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _render_readme_module():
    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "benchmarks" / "render_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_section_is_generated_from_committed_results():
    from attnzoo.bench import load
    rr = _render_readme_module()
    cpu_json = ROOT / "benchmarks" / "results" / "cpu" / "bench_cpu.json"
    cpu = (load(cpu_json), cpu_json) if cpu_json.exists() else None
    gpu = rr.gpu_section(ROOT / "benchmarks" / "results" / "gpu")
    text = README.read_text()
    section = text.split(rr.BEGIN + "\n", 1)[1].split(rr.END, 1)[0]
    assert section == rr.front_page(cpu, gpu, README, ROOT / "docs" / "benchmarks.md"), \
        "README's benchmark section is stale: run benchmarks/render_readme.py"
    assert "docs/benchmarks.md" in section


def test_available_matches_the_front_page():
    # the quick-start's comment shows the registry's names in their order
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("attnzoo.available()"))
    shown = ast.literal_eval(line.split("#", 1)[1].strip())
    assert attnzoo.available() == shown


def test_every_command_line_listing_names_every_subcommand():
    # "`attnzoo list | bench | ...`": the README's list, and any other page's, is the CLI's own
    import argparse

    from attnzoo.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    listings = {page: re.findall(r"`attnzoo ((?:[a-z-]+ \| )+[a-z-]+)`", page.read_text()) for page in PAGES}
    assert listings[README], "the README lists no commands as `attnzoo a | b | ...`"
    for page, found in listings.items():
        for listing in found:
            assert set(listing.split(" | ")) == commands, (str(page.relative_to(ROOT)), listing, sorted(commands))
