"""Every ``attnzoo`` subcommand checks its arguments before doing any work: bad input is one
``attnzoo COMMAND: error: ...`` line on stderr and exit status 2, no traceback, nothing written."""
from __future__ import annotations

import subprocess
import sys

import pytest

from attnzoo.cli import main

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_system_datasets")

CASES = [  # (argv, words the message must hold)
    (["list", "softmaxx"], ["softmaxx", "did you mean 'softmax'"]),
    (["list", "sinkhorn(n_iters=)"], ["sinkhorn"]),
    (["bench", "--variants", "softmaxx"], ["--variants", "softmaxx"]),
    (["bench", "--variants", "softmax", "--backends", "tritonn"], ["--backends", "tritonn"]),
    (["bench", "--skip-backends", "nope"], ["--skip-backends", "nope"]),
    (["bench", "--compare", "{tmp}/missing.json"], ["missing.json", "does not exist"]),
    (["bench", "--compare", "{tmp}/a.json", "{tmp}/b.json", "{tmp}/c.json"], ["--compare takes"]),
    (["bench", "--compare", "{tmp}/not_json.json"], ["not valid JSON"]),
    (["bench", "--from-jsonl", "{tmp}/missing.jsonl"], ["missing.jsonl"]),
    (["bench", "--seq-lens", "0"], ["seq_lens"]),
    (["bench", "--device", "tpu"], ["tpu"]),
    (["analyze", "lipschitz", "--variants", "softmaxx"], ["--variants", "softmaxx"]),
    (["analyze", "wasserstein", "--variants", "sinkhorn,nope"], ["nope"]),
    (["analyze", "wasserstein", "--tokens", "0"], ["--tokens"]),
    (["analyze", "lipschitz", "--radii", "0"], ["--radii"]),
    (["analyze", "topolip", "--variants", "softmaxx"], ["softmaxx"]),
    (["analyze", "topolip"], ["Fashion-MNIST", "apt-get install"]),
    (["analyze", "fenchel", "--checkpoint", "{tmp}/run"], ["--config"]),
    (["analyze", "fenchel", "--checkpoint", "{tmp}/run", "--config", "{tmp}/c.yaml"], ["does not exist"]),
    (["train", "configs/demo.yaml", "--set", "model.attention=softmaxx"], ["softmaxx"]),
    (["train", "configs/demo.yaml", "--resume", "{tmp}/nothing"], ["no checkpoint"]),
    (["demo", "--variants", "softmaxx"], ["softmaxx"]),
]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_bad_arguments_are_one_error_line(tmp_path, capsys, argv, words):
    (tmp_path / "not_json.json").write_text("{not json")
    out = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] in ("analyze", "bench"):
        argv += ["--out", str(out)]
    elif argv[0] in ("train",):
        argv += ["--out-dir", str(out)]
    elif argv[0] == "demo":
        argv += ["--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith(f"attnzoo {argv[0]}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err + captured.out
    for w in words:
        assert w in err, (w, err)
    assert not out.exists()  # checked before any folder was made


def test_the_installed_entry_point_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "attnzoo", "list", "softmaxx"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("attnzoo list: error: unknown attention variant 'softmaxx'")
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
