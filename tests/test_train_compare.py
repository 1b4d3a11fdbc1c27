"""attnzoo compare: several models x seeds, the table (mean and 95% CI next to the paper) and the
test curves; the shipped plans (paper 004's protocol, the ViT-only search)."""
from __future__ import annotations

import glob
import json
import math

import pytest
import yaml

from attnzoo.cli import main
from attnzoo.train import protocol
from attnzoo.train.compare import confidence_interval, welch_difference

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")

T_975 = {1: 12.7062, 2: 4.3027, 4: 2.7764}  # Student's t quantiles from a printed table


def test_confidence_interval_is_students_t():
    mean, half = confidence_interval([0.90, 0.92, 0.94])
    assert mean == pytest.approx(0.92) and half == pytest.approx(T_975[2] * 0.02 / math.sqrt(3), rel=1e-4)
    mean, half = confidence_interval([0.5, 0.7])
    assert half == pytest.approx(T_975[1] * math.sqrt(0.02) / math.sqrt(2), rel=1e-4)
    assert confidence_interval([0.9]) == (0.9, None)
    with pytest.raises(ValueError):
        confidence_interval([])


def test_welch_difference_matches_scipys_interval():
    from scipy.stats import ttest_ind
    a, b = [0.91, 0.93, 0.92, 0.95], [0.94, 0.97, 0.93]
    diff, half = welch_difference(a, b)
    lo, hi = ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
    assert diff == pytest.approx((lo + hi) / 2) and half == pytest.approx((hi - lo) / 2)
    assert welch_difference([0.9], [0.8, 0.85])[1] is None


TINY = ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", "data.synthetic=true",
        "data.synthetic_train_size=24", "data.synthetic_test_size=12", "train.epochs=2", "train.batch_size=8",
        "train.progress=false", "train.device=cpu", "train.plot=false", "data.augment=true"]


def _compare(tmp_path, *extra):
    args = ["compare", "configs/compare/paper004_cifar10.yaml", "--out-dir", str(tmp_path)]
    for s in TINY:
        args += ["--set", s]
    return main(args + list(extra))


def test_compare_trains_every_seed_and_writes_the_table(tmp_path, capsys, monkeypatch):
    assert _compare(tmp_path, "--seeds", "0", "1") == 0
    table = json.loads((tmp_path / "table.json").read_text())
    rows = {r["name"]: r for r in table["rows"]}
    assert list(rows) == ["vit", "otvit"] and all(r["seeds"] == [0, 1] for r in rows.values())
    for name, r in rows.items():
        finals = [json.loads((tmp_path / f"{name}_seed{s}" / "metrics.json").read_text())["final_test_acc"]
                  for s in (0, 1)]
        assert r["mean"] == pytest.approx(sum(finals) / 2)
        assert r["ci"] == pytest.approx(T_975[1] * abs(finals[0] - finals[1]) / 2, rel=1e-4, abs=1e-12)
    assert rows["vit"]["paper"] == {"mean": 0.751, "ci": 0.01} and rows["otvit"]["paper"]["mean"] == 0.772
    md = (tmp_path / "table.md").read_text()
    assert "| vit | 2 (0, 1) |" in md and "0.751 ± 0.010" in md and "otvit − vit" in md and "+0.021" in md
    assert (tmp_path / "test_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    # finished runs are kept; a new seed trains only itself
    trained = []
    from attnzoo.train import loop
    monkeypatch.setattr(loop, "train", lambda cfg, resume=None, log=None, **kw: trained.append(cfg.train.out_dir)
                        or _real_train(cfg, resume, log))
    assert _compare(tmp_path, "--seeds", "0", "1", "2") == 0
    assert sorted(trained) == sorted(str(tmp_path / f"{m}_seed2") for m in ("vit", "otvit"))
    assert "| vit | 3 (0, 1, 2) |" in (tmp_path / "table.md").read_text()

    # other settings in a finished run's folder: refused before anything trains, the key named
    trained.clear()
    assert _compare(tmp_path, "--seeds", "0", "--set", "optim.lr=1e-3") == 2
    assert "optim.lr" in capsys.readouterr().err and not trained


def _real_train(cfg, resume, log):
    from attnzoo.train.loop import _train
    from attnzoo.train import distributed as D
    return _train(cfg, resume, D.setup(cfg.train.device), lambda *a, **k: None)


def test_compare_resumes_a_run_that_stopped_part_way(tmp_path, monkeypatch):
    from attnzoo.train import loop
    plan = _plan(tmp_path)
    plan.runs = plan.runs[:1]
    real, calls = loop.train_one_epoch, []

    def dies_in_epoch_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_one_epoch", dies_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        protocol.run_plan(plan, log=lambda *a, **k: None)
    cfg = protocol.configs(plan)[0][2]
    assert protocol.status(cfg) == "partial"
    assert "still training" in protocol.report(plan)["text"]
    lines = []
    protocol.run_plan(plan, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert any("vit seed 0: resuming" in line for line in lines) and len(calls) == 3  # epoch 2 only
    assert protocol.status(cfg) == "done"
    assert json.loads((tmp_path / "vit_seed0" / "metrics.json").read_text())["epochs_done"] == 2


def _plan(tmp_path):
    plan = protocol.load_plan("configs/compare/paper004_cifar10.yaml")
    plan.out_dir, plan.seeds = tmp_path, [0]
    for r in plan.runs:
        r.overrides += TINY
    return plan


def test_compare_of_configs_and_bad_input(tmp_path, capsys):
    args = ["compare", "configs/vit_cifar10.yaml", "configs/otvit_cifar10.yaml", "--out-dir", str(tmp_path)]
    for s in TINY:
        args += ["--set", s]
    assert main(args) == 0
    assert [r["name"] for r in json.loads((tmp_path / "table.json").read_text())["rows"]] == ["vit_cifar10",
                                                                                             "otvit_cifar10"]
    capsys.readouterr()
    for bad, match in ((["compare", "nowhere.yaml"], "not found"),
                       (["compare", "configs/compare/paper004_cifar10.yaml", "--only", "resnet"], "resnet"),
                       (["compare", "configs/vit_cifar10.yaml", "--set", "train.epochs=0"], "train.epochs"),
                       (["compare", "configs/compare/paper004_cifar10.yaml", "configs/vit_cifar10.yaml"], "alone"),
                       (["compare", "configs/vit_cifar10.yaml", "--out-dir", str(tmp_path / "empty"),
                         "--report-only"], "no finished run")):
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1 and err.startswith("attnzoo compare: error:")


def test_bad_plans_are_named(tmp_path):
    for text, match in (("runs: {a: {config: configs/vit_cifar10.yaml}}\nsedes: [0]\n", "sedes"),
                        ("runs: {a: {config: configs/vit_cifar10.yaml, paper: 0.9}}\n", "paper"),
                        ("runs: {a: {config: configs/vit_cifar10.yaml}}\nseeds: []\n", "seeds"),
                        ("runs: {a: {config: configs/missing.yaml}}\n", "missing.yaml"),
                        ("runs: {a: {config: configs/vit_cifar10.yaml, sett: []}}\n", "sett")):
        path = tmp_path / "plan.yaml"
        path.write_text(text)
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            protocol.load_plan(path)


PAPER = {"fashion_mnist": (0.928, 0.937), "cifar10": (0.751, 0.772), "cifar100": (0.463, 0.491)}


@pytest.mark.parametrize("path", sorted(glob.glob("configs/compare/*.yaml")))
def test_shipped_plans_load_and_follow_the_protocol(path):
    plan = protocol.load_plan(path)
    planned = protocol.configs(plan)
    assert planned
    if "search" in path:   # ViT only, one seed per candidate, on a validation hold-out
        assert {cfg.model.name for _, _, cfg in planned} == {"vit"}
        assert all(cfg.data.validation_size for _, _, cfg in planned)
        assert len({(cfg.data.augment, cfg.data.crop_padding, cfg.data.flip, cfg.train.epochs)
                    for _, _, cfg in planned}) == len(plan.runs)
        return
    assert len(plan.seeds) >= 3 and [r.name for r in plan.runs] == ["vit", "otvit"]
    vit, otvit = (cfg for _, seed, cfg in planned if seed == plan.seeds[0])
    dataset = vit.data.dataset
    assert (plan.runs[0].paper["mean"], plan.runs[1].paper["mean"]) == PAPER[dataset]
    # the paper's settings, and the same training choices for both models
    for cfg in (vit, otvit):
        m = cfg.model
        assert (m.patch_size, m.depth, m.dropout, cfg.optim.lr) == (4, 6, 0.2, 3e-4)
        assert cfg.data.validation_size is None
    assert (otvit.model.ot_alpha, otvit.model.ot_gamma, otvit.data.partner_prob) == (1.0, "sqrt_embed_dim", 0.5)
    same = lambda c: (yaml.safe_dump(c.to_dict()["optim"]), c.data.augment, c.data.crop_padding, c.data.flip,  # noqa: E731
                      c.train.epochs, c.train.batch_size)
    assert same(vit) == same(otvit)
