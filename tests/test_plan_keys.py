"""What the plan cache (attnzoo/ops/plan.py) keys a call on: unhashable arguments take the full path
and get their own error; ``use_backend`` in another thread never leaves a plan keyed with one request
that runs another; a decoder growing its KV cache asks the dispatcher once per length class, not once
per token, and the class's choice is the one the dispatcher gives at every length inside it."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import dispatch, plan
from attnzoo.ops.kernels import blockwise


def _qkv(nq=6, nk=6, D=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, nq, D, generator=g, dtype=dtype),
            *(torch.randn(1, 2, nk, D, generator=g, dtype=dtype) for _ in range(2)))


@pytest.fixture
def decisions(monkeypatch):
    """The variant of every call whose backend was decided afresh (not taken from a kept plan or class)."""
    seen = []
    real = plan._decide

    def counting(name, *args, **kwargs):
        seen.append(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(plan, "_decide", counting)
    return seen


# -- issue 31 item 8: unhashable values of the shared arguments are named ------------------------------

@pytest.mark.parametrize("argument,value,message", [
    ("scale", np.array(0.5), "scale must be a real number"),
    ("is_causal", [True], "is_causal must be a bool"),
    ("dropout_p", np.array(0.1), "dropout_p must be"),
    ("enable_gqa", [True], "enable_gqa must be a bool"),
])
def test_an_unhashable_shared_argument_gets_its_own_error(argument, value, message):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=message):
        AF.softmax(q, k, v, **{argument: value})


def test_an_unhashable_backend_name_gets_its_own_error():
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError), match="backend must be"):
        AF.softmax(q, k, v, backend=["triton"])


# -- issue 31 item 10: use_backend in another thread ---------------------------------------------------

def _every_plan_runs_what_its_key_asked():
    """Each kept plan's key holds the request its choice answered."""
    return all(p.choice.requested in key for key, p in plan._PLANS.items())


def test_use_backend_switched_between_key_and_choice_does_not_leak(monkeypatch):
    """Another thread enters use_backend("reference") exactly between this call's keying and its
    choice (the worst moment, forced with events): the plan kept for the auto key must run auto's
    choice, so a later auto call of the same signature runs SDPA, not the reference."""
    q, k, v = _qkv()
    keyed, switched, done = threading.Event(), threading.Event(), threading.Event()
    real_signature = plan.signature

    def signature_then_wait(*args, **kwargs):
        out = real_signature(*args, **kwargs)
        keyed.set()
        switched.wait(5)
        return out
    monkeypatch.setattr(plan, "signature", signature_then_wait)

    def other_thread():
        keyed.wait(5)
        with attnzoo.use_backend("reference"):
            switched.set()
            done.wait(5)
    t = threading.Thread(target=other_thread)
    t.start()
    try:
        AF.softmax(q, k, v)
    finally:
        done.set()
        t.join()
    monkeypatch.setattr(plan, "signature", real_signature)
    assert _every_plan_runs_what_its_key_asked()
    key, _ = plan.signature("softmax", "auto", q, k, v, None, False, None, 0.0, False, {})
    assert plan.lookup(key).choice.backend.name == AF.explain("softmax", q, k, v).backend.name == "torch"


def test_use_backend_in_threads_keeps_every_plan_consistent():
    """Free-running threads: one toggles use_backend, two call attnzoo without backend=. Every kept plan
    runs what its key asked for."""
    q, k, v = _qkv()
    stop = threading.Event()
    errors = []

    def toggler():
        while not stop.is_set():
            with attnzoo.use_backend("reference"):
                pass

    def caller():
        try:
            for _ in range(300):
                plan.clear()
                AF.softmax(q, k, v)
                if not _every_plan_runs_what_its_key_asked():
                    errors.append("a plan keyed with one request runs another")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=toggler)] + [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors


# -- issue 28 item 2: decoding hits the plan ---------------------------------------------------------

def test_a_growing_key_length_decides_once_per_bucket(decisions):
    """Nq = 1 and Nk = 1..100 (a decode loop): buckets 1..16, 17..32, 33..64, 65..128, and Nk = 1 equal
    to Nq: 5 decisions. Every step still computes the formula (the checks are per signature)."""
    for nk in range(1, 101):
        q, k, v = _qkv(1, nk, dtype=torch.float64)
        out = AF.relu(q, k, v, is_causal=True)
        want = torch.relu(q @ k.transpose(-1, -2) * 0.5) @ v / nk
        torch.testing.assert_close(out, want)
    assert len(decisions) == 5


def test_a_class_whose_corners_disagree_is_not_kept(monkeypatch, decisions):
    """A size threshold inside a bucket (blockwise's small-call rule at 40 scores: Nk 17..32 with
    B H Nq = 2 holds 34..64) changes the choice: the class is not kept, and each length gets the
    dispatcher's own answer on each side of the threshold."""
    monkeypatch.setattr(blockwise, "SMALL_CALL_ELEMENTS", 40)
    plan.clear()
    ran = []
    for nk in (18, 19, 25, 30):
        q, k, v = _qkv(1, nk)
        AF.relu(q, k, v)
        key, _ = plan.signature("relu", "auto", q, k, v, None, False, None, 0.0, False, {})
        ran.append(plan.lookup(key).choice.backend.name)
        assert ran[-1] == AF.explain("relu", q, k, v).backend.name
    assert ran == ["reference", "reference", "cpu", "cpu"]
    assert len(decisions) == 4


def test_one_query_is_a_class_of_its_own(monkeypatch):
    """OT's CPU crossover has its own limit for a single query (a decode step), so Nq = 1 must not
    share a choice with Nq = 2..16. The limits are set so that the corners of a class mixing them agree
    on 'cpu' (one query of 17 keys; 16 queries of 32 keys: B*H*Nq*Nk*|A| = 32768 >= 10000) while two
    queries of 20 keys (1600) pick the reference: each call must run the dispatcher's own answer."""
    from attnzoo.ops import ot
    monkeypatch.setattr(ot, "OT_CPU_MIN_CUBE_SINGLE_QUERY", 1)
    monkeypatch.setattr(ot, "OT_CPU_MIN_CUBE", 10_000)
    plan.clear()
    ran = []
    for nq in (1, 2, 3):
        q, k, v = _qkv(nq, 20)
        AF.ot(q, k, v)
        key, _ = plan.signature("ot", "auto", q, k, v, None, False, None, 0.0, False, plan_options("ot"))
        ran.append(plan.lookup(key).choice.backend.name)
        assert ran[-1] == AF.explain("ot", q, k, v).backend.name
    assert ran == ["cpu", "reference", "reference"]


def plan_options(name):
    """The options a variant's functional passes to attend by default (part of the plan key)."""
    from attnzoo.ops import variant
    return dict(variant.get(name).options)


def test_masks_by_length_share_the_class_of_their_call(decisions):
    """A key-padding mask (B, 1, 1, Nk) grows with the keys: same class; a mask of another kind (per
    query and key) is another class."""
    for nk in (20, 21, 22):
        q, k, v = _qkv(1, nk)
        AF.softmax(q, k, v, attn_mask=torch.ones(1, 1, 1, nk, dtype=torch.bool))
    assert len(decisions) == 1
    q, k, v = _qkv(1, 23)
    AF.softmax(q, k, v, attn_mask=torch.ones(1, 2, 1, 23, dtype=torch.bool))
    assert len(decisions) == 2


transformers = pytest.importorskip("transformers", minversion="5.0")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec,tokens", [("softmax", 200), ("sinkhorn", 40)])
def test_a_200_token_generate_makes_at_most_8_decisions_per_layer(spec, tokens, decisions):
    """Greedy generate of 200 tokens from a 5-token prompt in a tiny swapped Llama (2 layers): about one
    decision per power-of-two bucket of the cache length (the prompt, then 16, 32, 64, 128, 256). Sinkhorn (its decode steps take every earlier
    query too, so Nq grows with Nk) over 40 tokens, to keep the test short."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                         pad_token_id=0, bos_token_id=None, eos_token_id=None))
    model = attnzoo.swap(model, spec).eval()
    plan.clear()
    ids = torch.tensor([[3, 8, 11, 5, 2]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             min_new_tokens=tokens)
    assert out.shape[1] == 5 + tokens
    # the layers share their plans (same shapes): the whole model's count bounds each layer's
    assert 0 < len(decisions) <= 8, f"{len(decisions)} decisions"
