"""The models the model benchmark trains, each built from its config (nothing is downloaded): timm's
ViT-S/16 and Hugging Face's BERT-base, GPT-2-small and a Llama-style model with grouped-query
attention, with their own attention or an attnzoo variant swapped in; and the packed rows
(``llama_padded`` / ``llama_packed``): a small Llama fine-tuned on one batch of mixed lengths, padded
or packed into one row (``packed_batch``), whose tokens/s count the real tokens only.

``full`` is the size the issue measures on a GPU (ViT-S/16 at 224 x 224, N = 197, batch 128; BERT-base
at 128 tokens; GPT-2-small and the Llama-style model at 1024 tokens, causal); ``tiny`` keeps each
architecture (patch embedding and class token; BERT's bidirectional masked LM; GPT-2's and Llama's
causal LM, Llama with 3 query heads per key/value head as in the full model) at a few thousand
parameters, so that the whole benchmark runs on a CPU in seconds. Dropout is off everywhere: the
benchmark compares attention kernels, and dropout would add random-number work that differs
between SDPA's and attnzoo's paths.

The swap: timm gets ``attn_layer=attnzoo.layer(spec)`` at creation; a Hugging Face model is built
with ``attn_implementation="sdpa"`` (its own attention, the baseline) and ``attnzoo.swap(model, spec)``
puts the variant into every attention module.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import registry
from ..adapters import swap
from . import packed_batch

SIZES = ("full", "tiny")
OWN = "own"   # the attention label of a model's own attention (timm's Attention, Hugging Face's sdpa)


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq: int      # tokens per sequence (ViT: patches + class token)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str                    # what the model is, for tables
    own: str                      # what its own attention is called
    unit: str                     # "images/s" or "tokens/s"
    causal: bool
    full: Shapes
    tiny: Shapes
    variants: tuple[str, ...]     # the variants benchmarked by default
    build: Callable[[str, Optional[str]], nn.Module]           # (size, spec or None) -> model
    batch_of: Callable[[nn.Module, Shapes, torch.device, torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    real_tokens: Optional[Callable[[Shapes], int]] = None      # a batch of mixed lengths: its tokens, no padding

    def shapes(self, size: str) -> Shapes:
        return self.full if size == "full" else self.tiny

    def items_per_step(self, shapes: Shapes) -> int:
        """Images per step (ViT) or tokens per step (language models; the real tokens of a batch of
        mixed lengths, padding left out)."""
        if self.real_tokens is not None:
            return self.real_tokens(shapes)
        return shapes.batch if self.unit == "images/s" else shapes.batch * shapes.seq


# -- timm ViT-S/16 ---------------------------------------------------------------------------------

def _vit(size: str, spec: Optional[str]) -> nn.Module:
    import timm
    from timm.models.vision_transformer import VisionTransformer
    attn = {} if spec is None else {"attn_layer": registry.layer(spec)}
    if size == "full":
        return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=1000, **attn)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10, **attn)


def _images(model: nn.Module, shapes: Shapes, device, g: torch.Generator) -> tuple:
    side = model.patch_embed.img_size[0]
    x = torch.randn(shapes.batch, 3, side, side, generator=g)
    y = torch.randint(0, model.num_classes, (shapes.batch,), generator=g)
    return x.to(device), y.to(device)


def _image_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- Hugging Face language models ------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns about tiny configs (special tokens outside a 128-word vocabulary, the
    default loss): noise in a benchmark's log. Its verbosity is put back afterwards."""
    from transformers.utils import logging
    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


@dataclass(frozen=True)
class _HF:
    """Builds a Hugging Face model from its config class with the given arguments (the rest are
    transformers' defaults: GPT2Config() is GPT-2-small, BertConfig() BERT-base)."""
    model_class: str
    config_class: str
    full: dict
    tiny: dict

    def config(self, size: str):
        import transformers
        with _quiet_transformers():
            return getattr(transformers, self.config_class)(**(self.full if size == "full" else self.tiny))

    def __call__(self, size: str, spec: Optional[str]) -> nn.Module:
        import transformers
        config = self.config(size)
        with _quiet_transformers():
            model = getattr(transformers, self.model_class)._from_config(config, attn_implementation="sdpa")
        if spec is not None:
            swap(model, spec, strict=True)
        return model


def _tokens(model: nn.Module, shapes: Shapes, device, g: torch.Generator) -> tuple:
    ids = torch.randint(0, model.config.vocab_size, (shapes.batch, shapes.seq), generator=g)
    return (ids.to(device),)


def _lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """The model's own loss with the input as labels (BERT: masked-LM loss on every token; GPT-2 and
    Llama: next-token loss)."""
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _mixed(pack: bool):
    """A batch of mixed lengths (packed_batch.mixed_lengths of shapes.seq), padded or packed in one row."""
    def batch_of(model: nn.Module, shapes: Shapes, device, g: torch.Generator) -> tuple:
        seqs = packed_batch.sequences(packed_batch.mixed_lengths(shapes.batch, shapes.seq),
                                      model.config.vocab_size, g)
        return (packed_batch.to_device((packed_batch.packed if pack else packed_batch.padded)(seqs), device),)
    return batch_of


def _mixed_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(**batch[0]).loss


def _mixed_tokens(shapes: Shapes) -> int:
    return sum(packed_batch.mixed_lengths(shapes.batch, shapes.seq))


_NO_DROPOUT_BERT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# (GPT2LMHeadModel's class name does not say which loss it trains with: transformers would warn)
_NO_DROPOUT_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "loss_type": "ForCausalLM"}
_TINY_LM = {"vocab_size": 128, "max_position_embeddings": 64}

# the kernels that run every row independently: what the language-model targets name
LM_VARIANTS = ("softmax", "l2", "sigmoid", "relu", "linear")
VIT_VARIANTS = ("softmax", "l2", "fenchel", "sigmoid", "relu", "linear", "sinkhorn(n_iters=3)", "ot")

# packing changes every variant's per-sequence normalisation (sigmoid's -log n, Sinkhorn's marginals)
_PACKED_VARIANTS = ("softmax", "sigmoid", "relu", "sinkhorn(n_iters=3)")
_SMALL_LLAMA = _HF("LlamaForCausalLM", "LlamaConfig", dict(packed_batch.SMALL_LLAMA),
                   {**_TINY_LM, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                    "num_attention_heads": 6, "num_key_value_heads": 2, "attention_dropout": 0.0})

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("vit_s", "timm vit_small_patch16_224 (ViT-S/16, 224 x 224)", "timm Attention", "images/s", False,
              Shapes(128, 197), Shapes(4, 17), VIT_VARIANTS, _vit, _images, _image_loss),
    ModelSpec("gpt2", "Hugging Face GPT-2-small (GPT2LMHeadModel, causal)", "HF sdpa", "tokens/s", True,
              Shapes(8, 1024), Shapes(2, 16), LM_VARIANTS,
              _HF("GPT2LMHeadModel", "GPT2Config", {**_NO_DROPOUT_GPT2},
                  {**_NO_DROPOUT_GPT2, "vocab_size": 128, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2,
                   "bos_token_id": 0, "eos_token_id": 0}),
              _tokens, _lm_loss),
    ModelSpec("llama", "Llama-style (LlamaForCausalLM: 12 query heads, 4 key/value heads, hidden 768, 12 layers)",
              "HF sdpa", "tokens/s", True, Shapes(8, 1024), Shapes(2, 16), LM_VARIANTS,
              _HF("LlamaForCausalLM", "LlamaConfig",
                  {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 1024},
                  {**_TINY_LM, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 6, "num_key_value_heads": 2}),
              _tokens, _lm_loss),
    *(ModelSpec(f"llama_{how}", f"small Llama (LlamaForCausalLM: hidden 256, 4 layers, 8 query heads, 4 key/value "
                                f"heads) fine-tuned on 8 sequences of mixed lengths (half the padded tokens padding), "
                                + ("packed into one row (restarting position_ids, cu_seq_lens)" if how == "packed"
                                   else "padded to the longest"),
                "HF sdpa", "tokens/s", True, Shapes(8, 512), Shapes(8, 16), _PACKED_VARIANTS, _SMALL_LLAMA,
                _mixed(how == "packed"), _mixed_loss, _mixed_tokens) for how in ("padded", "packed")),
    ModelSpec("bert", "Hugging Face BERT-base (BertForMaskedLM)", "HF sdpa", "tokens/s", False,
              Shapes(64, 128), Shapes(2, 16), LM_VARIANTS,
              _HF("BertForMaskedLM", "BertConfig", {**_NO_DROPOUT_BERT},
                  {**_NO_DROPOUT_BERT, **_TINY_LM, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "intermediate_size": 64}),
              _tokens, _lm_loss),
)}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    return MODELS[name]


def missing_library(name: str) -> Optional[str]:
    """Why the model cannot be built here (its library is not installed), or None."""
    import importlib.util
    module = "timm" if name == "vit_s" else "transformers"
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install {module})"
    return None
