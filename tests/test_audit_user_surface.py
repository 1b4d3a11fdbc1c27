"""What a new user meets first, from the outside: the command line's answers to bad input, the
names and options the docs promise, "multihead" inside a timm model, and sampling from a Hugging Face
model whose attention is attnzoo's. Each case here was a defect found by using the package as its
README says (a traceback, a silently dropped option, a random stream moved by a forward pass)."""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.cli import main
from tests import formulas as R

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)


# -- the command line: bad input is one error line, exit status 2 -----------------------------------

def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out
    assert err.startswith(f"attnzoo {command}: error: ") and err.count("\n") == 1, err
    return err


BAD_YAML = "model: {attention: softmax\ntrain: [1, 2\n"  # unclosed flow mapping


@pytest.mark.usefixtures("no_system_datasets")
@pytest.mark.parametrize("argv,named", [
    (["train", "{tmp}/bad.yaml", "--out-dir", "{tmp}/out"], "bad.yaml"),
    (["train", "configs/demo.yaml", "--set", "train.epochs=[1", "--out-dir", "{tmp}/out"], "--set train.epochs=[1"),
    (["compare", "{tmp}/bad.yaml", "--out-dir", "{tmp}/out"], "bad.yaml"),
    (["compare", "configs/demo.yaml", "--set", "train.epochs=[1", "--out-dir", "{tmp}/out"], "--set train.epochs"),
    (["demo", "--set", "train.epochs=[1", "--out", "{tmp}/out"], "--set train.epochs=[1"),
], ids=["train config", "train --set", "compare plan", "compare --set", "demo --set"])
def test_malformed_yaml_is_one_error_line(tmp_path, capsys, argv, named):
    # it was yaml's multi-line traceback with exit status 1
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = _one_error_line(capsys, argv[0])
    assert named in err and "not valid YAML" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config,words", [("bad.yaml", ["not valid YAML"]), ("bad.json", ["cannot be read"]),
                                           ("list.json", ["cannot be read"]), ("empty.yaml", ["no model section"])])
def test_analyze_fenchel_unreadable_config_is_one_error_line(tmp_path, capsys, config, words):
    # it was a yaml / json traceback, after the output folder was made
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "run.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    argv = ["analyze", "fenchel", "--checkpoint", str(tmp_path / "run.safetensors"), "--config",
            str(tmp_path / config), "--out", str(out)]
    assert main(argv) == 2
    err = _one_error_line(capsys, "analyze")
    assert f"--config '{tmp_path / config}'" in err and all(w in err for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("option,value", [("--tokens", "abc"), ("--radii", "1,x")])
def test_analyze_list_option_error_says_what_it_expected(capsys, option, value):
    # argparse names the type function: it was "invalid <lambda> value: 'abc'"
    with pytest.raises(SystemExit) as e:
        main(["analyze", "lipschitz", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: invalid comma-separated" in err and "<lambda>" not in err, err


def test_bench_bad_device_names_the_option(tmp_path, capsys):
    # it was torch's message alone ("Expected one of cpu, cuda, ... device string: tpu")
    assert main(["bench", "--device", "tpu", "--out", str(tmp_path / "out")]) == 2
    err = _one_error_line(capsys, "bench")
    assert "--device 'tpu'" in err, err


@pytest.mark.parametrize("option,field", [("--batch-tokens", "batch_tokens"), ("--max-call-seconds", "max_call_seconds")])
def test_bench_zero_is_refused_not_read_as_the_default(option, field, tmp_path, capsys):
    # 0 was read as "not given" and the default benchmark ran with the default value
    assert main(["bench", option, "0", "--out", str(tmp_path / "out")]) == 2
    err = _one_error_line(capsys, "bench")
    assert field in err and "got 0" in err, err
    assert not (tmp_path / "out").exists()


# -- names and options: a misspelling gets a suggestion --------------------------------------------

@pytest.mark.parametrize("call,words", [
    (lambda: attnzoo.create("sinkhorn(n_iterz=3)", 16, 2), ["n_iterz", "did you mean 'n_iters'", "'eps'"]),
    (lambda: attnzoo.layer("sigmoid(learnable_bais=True)"), ["did you mean 'learnable_bias'", "'bias'"]),
    (lambda: attnzoo.create("masked(kind='sinkhorn', n_iterz=2)", 16, 2), ["did you mean 'n_iters'"]),
    (lambda: attnzoo.create("zzzz", 16, 2), ["unknown attention variant 'zzzz'. Known: softmax"]),
    (lambda: attnzoo.MaskedAttention(16, 2, kind="sinkorn"), ["did you mean 'sinkhorn'"]),
    (lambda: attnzoo.create("masked(kind='sinkorn')", 16, 2), ["did you mean 'sinkhorn'"]),
    (lambda: attnzoo.functional.softmax(*torch.randn(3, 1, 1, 2, 4), backend="tritn"), ["did you mean 'triton'"]),
    (lambda: attnzoo.use_backend("refernce").__enter__(), ["did you mean 'reference'"]),
], ids=["create option", "layer option", "masked kind option", "unknown name", "masked kind", "masked spec kind",
        "backend", "use_backend"])
def test_misspelt_names_get_a_suggestion(call, words):
    with pytest.raises(ValueError) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- "multihead" inside a timm model ---------------------------------------------------------------

def _tiny_vit(attn_layer, **kw):
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3,
                             attn_layer=attn_layer, **kw)


def _sinkhorn_timm_float64(attn, x, n_iters):
    """timm's qkv / proj projections around Sinkhorn, float64, from tests/formulas.py."""
    w, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    B, N, E = x.shape
    H = attn.num_heads
    q, k, v = (torch.nn.functional.linear(x.double(), wi, bi).view(B, N, H, E // H).transpose(1, 2)
               for wi, bi in zip(w.chunk(3), b.chunk(3)))
    allow, add = R.allow_and_add(None, False, B, H, N, N)
    out = R.sinkhorn(q, k, v, allow, add, (E // H) ** -0.5, n_iters, 1.0, "l2", False)
    return attn.proj(out.transpose(1, 2).reshape(B, N, E).float())


@pytest.mark.parametrize("spec", ["multihead(kind='sinkhorn', n_iters=7)", "multihead(kind='sinkhorn(n_iters=7)')"])
def test_multihead_layer_in_a_timm_model_runs_its_kind_with_its_options(spec):
    # attnzoo.layer("multihead") was nn.MultiheadAttention's constructor, which timm's arguments broke
    # (TypeError), and the ViT's adapter dropped the kind's options (n_iters=7 ran as 3) and typos.
    # Since issue 31 it is the kind's own layer, timm's layout (tests/test_timm_multihead_layout.py)
    torch.manual_seed(0)
    vit = _tiny_vit(attnzoo.layer(spec)).eval()
    attn = vit.blocks[0].attn
    assert type(attn).__mro__[1] is attnzoo.SinkhornAttention
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.5)  # timm's init is tiny: Sinkhorn's iterations would barely show
        got = attn(x)
        want = _sinkhorn_timm_float64(attn, x, n_iters=7)
        default = _sinkhorn_timm_float64(attn, x, n_iters=3)
    assert float((want - default).abs().max()) > 100 * float((got - want).abs().max())  # the option shows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert vit(torch.randn(1, 3, 16, 16)).shape == (1, 3)


def test_multihead_in_a_timm_model_refuses_what_it_cannot_do():
    from attnzoo.models import ViT
    with pytest.raises(ValueError, match="n_iterz.*did you mean 'n_iters'"):   # as for "sinkhorn(n_iterz=7)"
        ViT(img_size=8, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2,
            attention="multihead(kind='sinkhorn', n_iterz=7)")


# -- Hugging Face: attnzoo's attention does not move the caller's random streams ---------------------

def _tiny_llama(implementation):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=None, eos_token_id=None,
                                        attn_implementation=implementation)).eval()


def test_first_hf_forward_keeps_the_random_stream_and_sampling_matches_without_cache():
    # The kernel of an "attnzoo_<variant>" implementation is built at the model's first forward; its
    # dropped projections' initialisation drew from torch's generator, so the first generate() sampled
    # other tokens than the same call later (use_cache=True vs False differed in a fresh process)
    pytest.importorskip("transformers", minversion="5.0")
    name = "attnzoo_audit_rng_relu"  # a fresh implementation: its kernel cache is empty
    attnzoo.register_hf_attention("relu", name=name)
    torch.manual_seed(0)
    model = _tiny_llama(name)
    ids = torch.tensor([[3, 8, 11, 5]])
    state = torch.get_rng_state()
    with torch.no_grad():
        model(ids)
    assert torch.equal(state, torch.get_rng_state())

    name = "attnzoo_audit_rng_sinkhorn"
    attnzoo.register_hf_attention("sinkhorn", name=name)
    torch.manual_seed(0)
    model = _tiny_llama(name)
    tokens = []
    for use_cache in (True, False):  # the first call builds the kernel
        torch.manual_seed(1)
        tokens.append(model.generate(input_ids=ids, max_new_tokens=6, do_sample=True, num_return_sequences=2,
                                     use_cache=use_cache, pad_token_id=0))
    assert torch.equal(tokens[0], tokens[1]), tokens
