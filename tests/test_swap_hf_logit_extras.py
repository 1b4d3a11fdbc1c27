"""Gemma 2 (logit softcapping, sliding layers), gpt-oss (learned attention sinks, sliding layers), Mistral
and Qwen 2 (sliding windows) built from tiny configs: attnzoo.swap(model, "softmax") computes HF's eager
attention; every variant that defines what the model needs trains, keeps causality and decodes with the
cache as without it; a variant that does not is refused at swap time in words a user knows. float64."""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.ops.variant

from .swap_helpers import VARIANTS, max_diff, reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM,  # noqa: E402
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

E, HEADS, KV, HEAD_DIM, VOCAB, WINDOW = 32, 4, 2, 8, 40, 4
IDS = torch.tensor([[3, 8, 11, 5, 2, 9, 14, 6, 1], [7, 1, 4, 12, 8, 2, 6, 3, 10]])
LEFT_PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
SMALL = dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
             num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=64, attention_dropout=0.0,
             pad_token_id=0, bos_token_id=None, eos_token_id=None)


def gemma2(impl):
    # a cap of 0.5 on logits of size ~1: a kernel that ignored it would be far off
    return Gemma2ForCausalLM(Gemma2Config(**SMALL, sliding_window=WINDOW, attn_logit_softcapping=0.5,
                                          final_logit_softcapping=None, query_pre_attn_scalar=HEAD_DIM,
                                          attn_implementation=impl))


def gpt_oss(impl):
    cfg = GptOssConfig(**{**SMALL, "intermediate_size": E}, sliding_window=WINDOW, num_local_experts=2,
                       num_experts_per_tok=1, attn_implementation=impl, experts_implementation="eager")
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks of size ~1 (the init draws them near 0, where they would hardly matter)
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.copy_(torch.randn(m.sinks.shape) * 1.5)
    return model


def mistral(impl):
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=WINDOW, attn_implementation=impl))


def qwen2(impl):
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=0, attn_implementation=impl))


FAMILIES = {"gemma2": gemma2, "gpt_oss": gpt_oss, "mistral": mistral, "qwen2": qwen2}
NEEDS = {"gemma2": "softcap", "gpt_oss": "sinks"}


def build(family, impl="eager"):
    """The model with its weights drawn larger than HF's init (std 0.02 gives attention logits of ~1e-3,
    where neither a cap of 0.5 nor a window would show in the output)."""
    torch.manual_seed(0)
    model = FAMILIES[family](impl).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.5)
    return model


def defines(spec, family) -> bool:
    need = NEEDS.get(family)
    record = attnzoo.ops.variant.get(attnzoo.registry.resolve(spec).kind)  # the variant a spec runs
    return need is None or need in record.extras


def swapped(family, spec):
    model = attnzoo.swap(build(family), spec)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # parameters a variant adds at zero: drawn, so they matter
        if "attnzoo_kernel" in name and not p.detach().any():
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_softmax_swap_is_hf_eager(family):
    eager, model = build(family), attnzoo.swap(build(family), "softmax", strict=True)
    # HF 5.24's eager Gemma 2, Mistral and Qwen 2 give NaN for a whole left-padded sequence (a padded
    # query's sliding-window row has no key): with padding, Mistral and Qwen 2 are compared with HF's sdpa
    hf = {None: eager, "pad": eager if family == "gpt_oss" else build(family, "sdpa") if family != "gemma2" else None}
    with torch.no_grad():
        for mask in (None, LEFT_PAD):
            if hf[None if mask is None else "pad"] is None:
                continue
            want = hf[None if mask is None else "pad"](IDS, attention_mask=mask).logits
            got = model(IDS, attention_mask=mask).logits
            real = torch.ones_like(IDS, dtype=torch.bool) if mask is None else mask.bool()
            assert torch.isfinite(want[real]).all()
            # HF's eager attention takes its softmax in float32 (softmax(..., dtype=float32)): 1e-6
            assert max_diff(got[real], want[real]) <= 1e-6
        if family in NEEDS:  # the argument matters: the same model without it is far away
            for m in eager.modules():
                if hasattr(m, "attn_logit_softcapping"):
                    m.attn_logit_softcapping = None
                if hasattr(m, "sinks"):
                    m.sinks.fill_(-torch.inf)
            assert max_diff(eager(IDS).logits, model(IDS).logits) > 1e-3


def test_the_kernel_gets_softcap_sinks_and_the_window(monkeypatch):
    from attnzoo.adapters import hf
    seen = []
    real = hf.run_kernel

    def spy(kernel, q, k, v, **kw):
        seen.append(dict(kw.get("extras") or {}))
        return real(kernel, q, k, v, **kw)

    monkeypatch.setattr(hf, "run_kernel", spy)
    with torch.no_grad():
        attnzoo.swap(build("gemma2"), "softmax")(IDS)
        attnzoo.swap(build("gpt_oss"), "softmax")(IDS)
    # Gemma 2 and gpt-oss alternate sliding and full layers; HF's window is the 4 keys up to the query
    assert [(e.get("softcap"), e.get("window_size")) for e in seen[:2]] == [(0.5, (WINDOW - 1, 0)), (0.5, None)]
    assert [e.get("window_size") for e in seen[2:]] == [(WINDOW - 1, 0), None]
    assert all(e["sinks"].shape == (HEADS,) and e["sinks"].requires_grad for e in seen[2:])


def cases():
    """Every variant in the models with softcap or sinks, where it defines them (the others are refused:
    test_variants_without_the_math_are_refused_at_swap_time); a few in the window-only models, which
    reach the kernel as a window with HF's mask (already tested for every variant in tests/test_swap_hf*)."""
    out = []
    for family in FAMILIES:
        for spec in VARIANTS if family in NEEDS else ["softmax", "sigmoid", "sinkhorn"]:
            if not defines(spec, family):
                continue
            out.append(pytest.param(family, spec, id=f"{family}-{spec}"))
    return out


@pytest.mark.parametrize("family,backend", [("gemma2", "reference"), ("gemma2", "cpu"), ("mistral", "reference"),
                                            ("mistral", "cpu"), ("qwen2", "cpu")])
@pytest.mark.parametrize("cache", ["sliding", "full"])
def test_sinkhorn_decodes_under_a_window_with_left_padding(family, backend, cache):
    """A variant that couples queries, under a sliding window, with left padding, generating past the
    window (the padding and the first tokens leave it): the cached steps equal the uncached forward.
    The model's own cache keeps only the window's keys in its sliding layers; a plain DynamicCache()
    keeps every key, and HF's one-row mask then drops those that left the window. Backend "cpu": the
    uncached forwards solve the window problems batched (test_sinkhorn_window_layers_run_batched)."""
    model = swapped(family, "sinkhorn")
    prompt, pad = IDS[:, :6], LEFT_PAD[:, :6]
    with torch.no_grad(), attnzoo.use_backend(backend):
        out = {}
        for use_cache in (True, False):
            given = {"cache": transformers.DynamicCache()} if use_cache and cache == "full" else {}
            out[use_cache] = model.generate(prompt, attention_mask=pad, max_new_tokens=6, do_sample=False,
                                            use_cache=use_cache, output_logits=True, return_dict_in_generate=True,
                                            **given)
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert max(max_diff(a, b) for a, b in zip(out[True].logits, out[False].logits)) <= 1e-10


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sinkhorn_window_layers_run_batched(family, monkeypatch):
    """Mistral / Qwen 2 with sliding_window=4 and left padding in a batch of 2, Sinkhorn on the "cpu"
    backend: HF's causal AND band AND padding mask reaches the kernel as the per-key padding row with
    is_causal and window_size, so each row's window problem is solved in batches (the prefix loop never
    runs), and the logits and the gradients equal the reference backend's (the band folded into HF's
    dense mask: the rule by construction) to float64 roundoff."""
    from attnzoo.adapters import hf
    from attnzoo.ops.sinkhorn import causal_window, cpu
    seen, batched = [], []
    real_run, real_window = hf.run_kernel, cpu.causal_by_window

    def spy(kernel, q, k, v, *, attn_mask=None, **kw):
        seen.append((None if attn_mask is None else tuple(attn_mask.shape), kw.get("is_causal"),
                     (kw.get("extras") or {}).get("window_size")))
        return real_run(kernel, q, k, v, attn_mask=attn_mask, **kw)

    model = swapped(family, "sinkhorn")
    want = {}
    with attnzoo.use_backend("reference"):
        want["logits"] = model(IDS, attention_mask=LEFT_PAD).logits
        want["grads"] = torch.autograd.grad(want["logits"][LEFT_PAD.bool()].square().sum(), list(model.parameters()))
    monkeypatch.setattr(hf, "run_kernel", spy)
    monkeypatch.setattr(cpu, "causal_by_prefix", lambda *a, **k: pytest.fail("ran the prefix loop"))
    monkeypatch.setattr(cpu, "causal_by_window", lambda *a, **k: batched.append(1) or real_window(*a, **k))
    with attnzoo.use_backend("cpu"):
        got = model(IDS, attention_mask=LEFT_PAD).logits
        grads = torch.autograd.grad(got[LEFT_PAD.bool()].square().sum(), list(model.parameters()))
    assert seen == [((2, 1, 1, IDS.shape[1]), True, (WINDOW - 1, 0))] * 2
    assert len(batched) == 2 and causal_window.takes(True, torch.ones(2, 1, 1, 9, dtype=torch.bool), WINDOW - 1, 9)
    real = LEFT_PAD.bool()
    assert max_diff(got[real], want["logits"][real]) <= 1e-10
    assert max(max_diff(a, b) for a, b in zip(grads, want["grads"])) <= 1e-10


def test_sinkhorn_gemma2_softcap_on_cpu_is_the_reference(monkeypatch):
    """Gemma 2 (a cap of 0.5, sliding and full layers) with Sinkhorn on the streaming "cpu" backend: every
    layer's call computes the cap itself (the sliding layers as batched window problems, the full ones by
    the prefix loop), and the logits and gradients equal the reference backend's to float64 roundoff."""
    from attnzoo.ops.sinkhorn import cpu
    caps = []
    real = cpu.streaming_sinkhorn
    monkeypatch.setattr(cpu, "streaming_sinkhorn", lambda *a, **kw: caps.append(kw["softcap"]) or real(*a, **kw))
    model = swapped("gemma2", "sinkhorn")
    out = {}
    for backend in ("reference", "cpu"):
        with attnzoo.use_backend(backend):
            logits = model(IDS, attention_mask=LEFT_PAD).logits
            grads = torch.autograd.grad(logits[LEFT_PAD.bool()].square().sum(), list(model.parameters()))
        out[backend] = (logits, grads)
    assert caps and set(caps) == {0.5}
    real_rows = LEFT_PAD.bool()
    assert max_diff(out["cpu"][0][real_rows], out["reference"][0][real_rows]) <= 1e-10
    assert max(max_diff(a, b) for a, b in zip(out["cpu"][1], out["reference"][1])) <= 1e-10


def test_sinkhorn_beam_search_under_a_window():
    """Beam search reorders a sliding cache's rows: the kept queries follow them (matched row by row)."""
    model = swapped("gemma2", "sinkhorn")
    with torch.no_grad():
        out = {use_cache: model.generate(IDS[:, :6], attention_mask=LEFT_PAD[:, :6], max_new_tokens=5,
                                         do_sample=False, num_beams=3, use_cache=use_cache, output_scores=True,
                                         return_dict_in_generate=True) for use_cache in (True, False)}
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert max(max_diff(a, b) for a, b in zip(out[True].scores, out[False].scores)) <= 1e-10


@pytest.mark.parametrize("cache", ["sliding", "full"])
def test_sinkhorn_cached_chunk_of_several_tokens_under_a_window(cache):
    """Several new tokens in one cached call (as assisted decoding verifies its candidates), under a
    window and left padding: each new row equals the same row of one uncached forward over all tokens."""
    model = swapped("mistral", "sinkhorn")
    with torch.no_grad():
        full = model(IDS, attention_mask=LEFT_PAD).logits
        given = {"cache": transformers.DynamicCache()} if cache == "full" else {}
        first = model(IDS[:, :6], attention_mask=LEFT_PAD[:, :6], use_cache=True, **given)
        rest = model(IDS[:, 6:], attention_mask=LEFT_PAD, cache=first.past_key_values, use_cache=True).logits
    real = LEFT_PAD[:, :6].bool()
    assert max_diff(first.logits[real], full[:, :6][real]) <= 1e-10
    assert max_diff(rest, full[:, 6:]) <= 1e-10


@pytest.mark.parametrize("family,spec", cases())
def test_every_variant_trains_keeps_causality_and_decodes(family, spec):
    model = swapped(family, spec)
    with torch.no_grad():
        full = model(IDS).logits
        prefix = model(IDS[:, :5]).logits
        # no later token moves an earlier output (and an output does not depend on how many follow)
        assert max_diff(full[:, :5], prefix) <= 1e-10
        out = {}
        for use_cache in (True, False):
            out[use_cache] = model.generate(IDS[:, :5], max_new_tokens=4, do_sample=False, use_cache=use_cache,
                                            output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert max(max_diff(a, b) for a, b in zip(out[True].logits, out[False].logits)) <= 1e-10
    model.train()
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is None or torch.isfinite(g).all() for g in grads)
    if family == "gpt_oss":  # the learned sinks train (HF's own parameter, loaded from gpt-oss checkpoints)
        assert all(m.sinks.grad is not None and m.sinks.grad.abs().max() > 0
                   for m in model.modules() if hasattr(m, "sinks"))


@pytest.mark.parametrize("family,words", [("gemma2", "logit softcapping"), ("gpt_oss", "attention sinks")])
def test_variants_without_the_math_are_refused_at_swap_time(family, words):
    refused = [spec for spec in VARIANTS if not defines(spec, family)]
    assert "linear" in refused
    model = build(family)
    for spec in refused:
        report = attnzoo.plan_swap(model, spec)
        reasons = [e.reason for e in report.entries if e.action == "unsupported"]
        assert len(reasons) == 2 and all(words in r and "does not support" in r for r in reasons), reasons
        with pytest.raises(ValueError, match=words):
            attnzoo.swap(model, spec, strict=True)
    assert all(e.action == "swap" for e in attnzoo.plan_swap(model, "softmax").entries)


def test_output_attentions_warns_that_no_weights_come_back():
    model = attnzoo.swap(build("mistral"), "softmax")
    with pytest.warns(UserWarning, match="output_attentions=True: attnzoo's kernels never form"), torch.no_grad():
        out = model(IDS, output_attentions=True)
    assert all(a is None for a in out.attentions)
