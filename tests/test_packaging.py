"""The package's metadata: one version (attnzoo.__version__, which pyproject.toml reads and
``attnzoo --version`` prints) and a license that setuptools reads without a warning (the SPDX string
form of ``project.license``; the TOML table form printed 88 lines of warnings on ``pip install -e .``)."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import attnzoo
from attnzoo.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_flag_in_process(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"attnzoo {attnzoo.__version__}\n"


def test_version_flag_from_a_fresh_interpreter():
    proc = subprocess.run([sys.executable, "-m", "attnzoo", "--version"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"attnzoo {attnzoo.__version__}"


def test_installed_metadata_has_the_same_version():
    try:
        installed = importlib.metadata.version("attnzoo")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("attnzoo is not installed (pip install -e .): no metadata to compare")
    assert installed == attnzoo.__version__


def setuptools_configuration():
    """pyproject.toml as setuptools reads it when building (the warnings it gives included)."""
    setuptools = pytest.importorskip("setuptools")
    major = int(setuptools.__version__.split(".")[0])
    if major < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates the SPDX license form pyproject.toml uses "
                    f"(the build requires >=77; pip install -e '.[dev]' brings it)")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    return dist, [str(w.message) for w in caught]


def test_setuptools_reads_pyproject_without_warnings(monkeypatch):
    monkeypatch.chdir(ROOT)  # the dynamic version's attr is found from the project root
    dist, caught = setuptools_configuration()
    assert not caught, "\n\n".join(caught)
    assert dist.metadata.version == attnzoo.__version__
    assert dist.metadata.license_expression == "MIT"
