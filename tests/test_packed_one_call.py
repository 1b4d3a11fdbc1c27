"""Which route a packed host call takes (layers/packed_attend.py): one ``attend_varlen`` call for all
the sequences whenever the layer's per-call values allow it, per sequence length otherwise, and the
same numbers either way. Through a layer's packed forward (cu_seqlens), MultiheadAttention's jagged
inputs and a swapped Hugging Face Llama's packed route (restarting position ids); on CPU with backend
"cpu" the one call is the blockwise packed path, so the per-length route is patched to fail there.
Outputs and parameter gradients against each sequence run alone (float64)."""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.ops import varlen

from tests.test_varlen_layers import DIM, HEADS, LENGTHS, layer_and_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

CU = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
TOL = 1e-10
# the layer specs whose per-call values are the same in every sequence (or per key token)
ONE_CALL = [s for s in attnzoo.available() if s != "multihead"] + [
    "fenchel(preference='context')", "fenchel(preference='t5')", "l2(tie_qk=True)",
    "sigmoid(bias=-1.0, learnable_bias=True)", "softmax(sinks=True, softcap=5.0)", "masked(kind='sinkhorn')"]
# a learned shift on the default bias -log n_i is a value per row of each sequence
PER_LENGTH = ["sigmoid(learnable_bias=True)"]
# layers of the variants with a blockwise packed form (their plain forms: tests/test_varlen_blockwise.py)
BLOCKWISE = ["l2(tie_qk=True)", "relu", "sigmoid", "sigmoid(bias=-1.0, learnable_bias=True)",
             "fenchel(preference='context')", "softmax(sinks=True, softcap=5.0)", "masked(kind='relu')"]


@pytest.fixture
def varlen_calls(monkeypatch):
    calls = []
    real = varlen.attend_varlen

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen, "attend_varlen", counting)
    return calls


def assert_same_as_alone(layer, xs, packed_forward, causal):
    alone = torch.cat([layer(x[None], is_causal=causal)[0] for x in xs])
    packed = packed_forward()
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=TOL)
    w = torch.randn(alone.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    params = list(layer.parameters())
    for got, want in zip(torch.autograd.grad((packed * w).sum(), params), torch.autograd.grad((alone * w).sum(), params)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("spec", ONE_CALL + PER_LENGTH)
def test_a_packed_layer_takes_one_varlen_call_when_its_values_allow(spec, varlen_calls):
    """Causal (tests/test_varlen_layers.py runs every registered layer both ways through this route)."""
    causal = True
    layer, xs = layer_and_tokens(spec)
    assert_same_as_alone(layer, xs, lambda: layer(torch.cat(xs), cu_seqlens=CU, max_seqlen=max(LENGTHS),
                                                  is_causal=causal), causal)
    assert len(varlen_calls) == (0 if spec in PER_LENGTH else 1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("spec", BLOCKWISE)
def test_blockwise_variants_run_every_sequence_in_one_blockwise_call(spec, causal, no_per_length):
    layer, xs = layer_and_tokens(spec)
    with attnzoo.use_backend("cpu"):
        assert_same_as_alone(layer, xs, lambda: layer(torch.nested.nested_tensor(xs, layout=torch.jagged),
                                                      is_causal=causal).values(), causal)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid(bias=-2.0)"])
def test_jagged_multihead_attention_runs_its_kind_in_one_blockwise_call(kind, no_per_length):
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(DIM, HEADS, kind=kind, batch_first=True).double()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in LENGTHS]
    nested = torch.nested.nested_tensor(xs, layout=torch.jagged)
    with attnzoo.use_backend("cpu"):
        got = mha(nested, nested, nested, need_weights=False, is_causal=False)[0].values()
        alone = torch.cat([mha(x[None], x[None], x[None], need_weights=False)[0][0] for x in xs])
    torch.testing.assert_close(got, alone, atol=TOL, rtol=TOL)


transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB, LAYERS = 40, 2


def swapped_llama(spec):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32, attention_dropout=0.0))
    model = attnzoo.swap(model.double().eval(), spec)
    g = torch.Generator().manual_seed(1)  # parameters a variant adds start at zero: draw them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attnzoo_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def llama_packed_vs_alone(spec, backend):
    model = swapped_llama(spec)
    ids = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(10 + i))
           for i, n in enumerate(LENGTHS)]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad(), attnzoo.use_backend(backend):
        packed = model(torch.cat(ids)[None], position_ids=positions, use_cache=False).logits[0]
        alone = [model(i[None], use_cache=False).logits[0] for i in ids]
    return packed, torch.cat(alone)


@pytest.mark.parametrize("spec", ["softmax", "sinkhorn", "fenchel(preference='context')", "fenchel(preference='t5')",
                                  "sigmoid(learnable_bias=True)"])
def test_hf_packed_route_takes_one_varlen_call_per_layer(spec, varlen_calls):
    packed, alone = llama_packed_vs_alone(spec, "reference")
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=TOL)
    assert len(varlen_calls) == (0 if spec in PER_LENGTH else LAYERS)


@pytest.mark.parametrize("spec", ["l2(tie_qk=True)", "fenchel(preference='context')"])
def test_hf_packed_route_runs_the_blockwise_path_in_one_call(spec, no_per_length):
    """Grouped heads (4 query heads on 2 key heads); the unpacked runs take the ordinary blockwise backend."""
    packed, alone = llama_packed_vs_alone(spec, "cpu")
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=TOL)


def test_a_packed_layer_compiles_to_one_graph():
    """Under torch.compile the one varlen call takes its padded route (offsets as tensors, no host read),
    the context preference's per-key log u padded per sequence with it: fullgraph=True holds."""
    layer, xs = layer_and_tokens("fenchel(preference='context')")

    def forward(x, cu):
        return layer(x, cu_seqlens=cu, max_seqlen=max(LENGTHS), is_causal=True)

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.cat(xs), CU), torch.cat([layer(x[None], is_causal=True)[0] for x in xs]),
                               atol=TOL, rtol=TOL)
