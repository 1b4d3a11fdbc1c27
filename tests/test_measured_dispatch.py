"""auto's measured rankings: the nearest measured case decides the order auto tries backends in,
a backend that refuses the call is passed over, explicit names ignore the table, and the T5 router
follows the same table."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch, measured
from attnzoo.ops.fenchel import t5


def _entry(variant, n, head_dim, ranking, causal=False, direction="fwd", dtype="bfloat16", flavour="plain"):
    return {"variant": variant, "flavour": flavour, "dtype": dtype, "causal": causal, "head_dim": head_dim, "n": n,
            "direction": direction, "ranking": ranking}


ENTRIES = (
    _entry("l2", 1024, 64, ["triton", "torch"]),
    _entry("l2", 16384, 64, ["torch", "triton"]),
    _entry("l2", 4096, 128, ["flex", "torch"]),
    _entry("l2", 4096, 64, ["torch"], causal=True),
    _entry("l2", 4096, 64, ["cpu"], dtype="float32"),
)


@pytest.mark.parametrize("n,d,causal,dtype,want", [
    (1024, 64, False, "bfloat16", ("triton", "torch")),
    (2000, 64, False, "bfloat16", ("triton", "torch")),    # log2 distance 0.97 to 1024 < 3.03 to 16384
    (9000, 64, False, "bfloat16", ("torch", "triton")),
    (4096, 128, False, "bfloat16", ("flex", "torch")),     # head dim weighs before N
    (4096, 96, False, "bfloat16", ("flex", "torch")),
    (4096, 64, True, "bfloat16", ("torch",)),              # causality must match
    (4096, 64, False, "float32", ("cpu",)),                # the same dtype wins when measured
    (4096, 64, False, "float16", ("triton", "torch")),     # otherwise the nearest shape of any dtype
])
def test_nearest_ranking(n, d, causal, dtype, want):
    assert measured.nearest_ranking(ENTRIES, "l2", "plain", dtype, causal, d, n, "fwd") == want


def test_nothing_measured_gives_no_ranking():
    assert measured.nearest_ranking(ENTRIES, "relu", "plain", "bfloat16", False, 64, 1024, "fwd") == ()
    assert measured.nearest_ranking(ENTRIES, "l2", "mask", "bfloat16", False, 64, 1024, "fwd") == ()
    assert measured.nearest_ranking(ENTRIES, "l2", "plain", "bfloat16", False, 64, 1024, "fwd+bwd") == ()


def test_flavour_names_what_changes_the_winner():
    mask = torch.ones(3, dtype=torch.bool)
    assert measured.flavour("l2", {}) == "plain"
    assert measured.flavour("l2", {"attn_mask": mask}) == "mask"
    assert measured.flavour("fenchel", {"log_u": torch.zeros(3)}) == "log_u"
    assert measured.flavour("linear", {"feature_map": "identity"}) == "identity"
    assert measured.flavour("linear", {"feature_map": "elu"}) == "plain"
    assert measured.flavour("ot", {"templates_k": torch.zeros(1), "dropout_p": 0.1}) == "templates+dropout"


def test_cpu_tensors_have_no_ranking():
    q = torch.randn(1, 1, 4, 8)
    assert measured.ranking("l2", q, q, q, {}) == ()


def test_auto_follows_the_ranking_and_skips_what_refuses(monkeypatch):
    q = torch.randn(1, 2, 8, 4)
    monkeypatch.setattr(measured, "ranking", lambda variant, *a: ("cpu", "torch") if variant == "l2" else ())
    # "cpu" refuses dropout (its reason is recorded), "torch" is next in the measured order
    choice = AF.explain("l2", q, q, q, dropout_p=0.1)
    assert choice.backend.name == "torch" and "cpu" in choice.reasons and choice.measured_order == ("cpu", "torch")
    monkeypatch.setattr(measured, "ranking", lambda variant, *a: ("reference",) if variant == "l2" else ())
    assert AF.explain("l2", q, q, q).backend.name == "reference"  # measured first beats priority
    assert AF.explain("l2", q, q, q, backend="torch").backend.name == "torch"  # a name ignores the table
    out = AF.l2(q, q, q)
    torch.testing.assert_close(out, AF.l2(q, q, q, backend="torch"), rtol=1e-5, atol=1e-6)


def test_unknown_names_in_a_table_are_ignored(monkeypatch):
    q = torch.randn(1, 1, 4, 4)
    monkeypatch.setattr(measured, "ranking", lambda *a: ("no-such-backend",))
    assert AF.explain("softmax", q, q, q).backend.name == dispatch.choose("softmax", None, q, q, q, attn_mask=None,
                                                                           is_causal=False, scale=0.5,
                                                                           dropout_p=0.0).backend.name


def test_use_backend_is_a_plain_setting_and_checks_its_name():
    assert dispatch.default_backend() == "auto"
    with dispatch.use_backend("reference"):
        assert dispatch.default_backend() == "reference"
        q = torch.randn(1, 1, 4, 4)
        assert AF.explain("relu", q, q, q).backend.name == "reference"
    assert dispatch.default_backend() == "auto"
    with pytest.raises(ValueError, match="use_backend: name must be one of"):
        with dispatch.use_backend("sdpa"):
            pass


def test_t5_router(monkeypatch):
    q = torch.randn(1, 2, 5, 8)
    assert t5.choose(q, q, q) is None  # CPU auto: the dense path
    with pytest.raises(ValueError, match="backend='flex' cannot run this fenchel \\(T5\\) call: FlexAttention runs"):
        t5.choose(q, q, q, backend="flex")
    assert t5.choose(q, q, q, backend="torch") is None  # any other fenchel backend: dense
    with dispatch.use_backend("reference"):
        assert t5.choose(q, q, q) is None


def test_the_lookup_traces_into_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) through auto's measured lookup: no file-system or device query
    may be traced (on a GPU an os.stat in this path failed every layer's compile). The lookup is
    exercised on CPU tensors by ranking CPU calls too, with a table of this test's own."""
    monkeypatch.setattr(measured, "RANKED_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(measured, "_entries_for_device", lambda index: ((_entry("l2", 8, 4, ["reference"]),),))
    measured._tables.cache_clear()
    torch._dynamo.reset()
    q = torch.randn(1, 2, 8, 4)

    def f(q):
        return AF.l2(q, q, q)
    out = torch.compile(f, fullgraph=True, backend="eager")(q)
    assert AF.explain("l2", q, q, q).backend.name == "reference"
    torch.testing.assert_close(out, AF.l2(q, q, q, backend="reference"))
    torch._dynamo.reset()


def test_own_table_first_then_same_capability(monkeypatch):
    """A device's own table ranks the cases it measured; the cases its (partial) run left out come
    from a table of the same compute capability; another capability's table is never used."""
    own = {"capability": [9, 0], "entries": [_entry("sigmoid", 4096, 64, ["triton", "reference"])]}
    sibling = {"capability": [9, 0], "entries": [_entry("sigmoid", 4096, 64, ["reference", "triton"]),
                                                _entry("l2", 4096, 64, ["torch", "triton"])]}
    other = {"capability": [8, 0], "entries": [_entry("relu", 4096, 64, ["triton"])]}
    monkeypatch.setattr(measured, "_tables", lambda: (("gpu-a", (9, 0), tuple(own["entries"])),
                                                      ("gpu-b", (9, 0), tuple(sibling["entries"])),
                                                      ("gpu-c", (8, 0), tuple(other["entries"]))))
    tables = measured.tables_for("gpu-a", (9, 0))
    assert [len(t) for t in tables] == [1, 2]

    def rank(variant):
        for entries in tables:
            found = measured.nearest_ranking(entries, variant, "plain", "bfloat16", False, 64, 4096, "fwd")
            if found:
                return found
        return ()
    assert rank("sigmoid") == ("triton", "reference")   # the own measurement wins
    assert rank("l2") == ("torch", "triton")             # left out by the own run: the sibling's
    assert rank("relu") == ()                            # another capability: priorities decide
