"""Baselines timed in the same run as attnzoo: torch SDPA (each backend it offers on the device),
FlexAttention (CUDA, variants it can express), flash-attn and flash-linear-attention when they are
installed, and torch.nn.MultiheadAttention for the multihead module.

SDPA's default dispatch on the same device is the anchor of every ratio ("x SDPA").
The CUDA-only paths here (FlexAttention, flash-attn, fla, SDPA's CUDA backends) have not been run
in this repository's CI (no GPU): they are written against those libraries' documented APIs.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import logit_extras
from .errors import Unavailable, Unsupported
from .extras_inputs import extras_of
from .problem import Problem, qkv, randn
from .targets import Case, Prepared, parse_variant

SDPA = "sdpa"
_SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                  "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-math": "MATH"}
_CPU_SDPA = ("sdpa-flash", "sdpa-math")   # what SDPA offers on CPU
FLEX, FLASH_ATTN, FLA, TORCH_MHA = "torch-flex", "flash-attn", "fla", "torch-mha"
BASELINE_NAMES = (SDPA, *_SDPA_BACKENDS, FLEX, FLASH_ATTN, FLA, TORCH_MHA)


class Baseline(Case):
    kind = "baseline"


class SdpaTarget(Baseline):
    """F.scaled_dot_product_attention, default dispatch ("sdpa") or one backend forced with sdpa_kernel.
    Causal: SDPA's top-left is_causal equals attnzoo's bottom-right one here (Nq == Nk)."""

    def prepare(self, problem: Problem) -> Prepared:
        causal = self.spec.causal(problem.causal)
        q, k, v = qkv(problem)
        if problem.shape.seq_q != problem.shape.nk and causal:
            raise Unsupported("SDPA's is_causal is top-left aligned; attnzoo's causal is bottom-right (Nq != Nk)")
        forced = _SDPA_BACKENDS.get(self.backend)
        if forced is None:
            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:  # the forward picks the kernel, its backward follows: forcing the forward forces both
            from torch.nn.attention import SDPBackend, sdpa_kernel
            which = getattr(SDPBackend, forced)

            def forward():
                with sdpa_kernel([which]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return Prepared(forward, [q, k, v], self.backend, ("sdpa", self.backend, problem.key(), causal),
                        materialises=self.backend == "sdpa-math")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class FlexTarget(Baseline):
    """torch.nn.attention.flex_attention (compiled once per process) with a score_mod per variant and a
    causal BlockMask; a flavour's inputs (``FLEX_TERMS``: a T5 table, a per-key bias) add their term.
    FlexAttention hard-wires the softmax normalisation: only softmax, l2 and first-order Fenchel
    without a preference tensor are expressible."""

    EXPRESSIBLE = ("softmax", "l2", "fenchel")
    compiles = True   # each new shape / score_mod / mode costs a torch.compile: planned last

    def prepare(self, problem: Problem) -> Prepared:
        kernel, kw = self.spec.kernel, self.spec.kernel_kwargs
        if kernel not in self.EXPRESSIBLE or (kernel == "fenchel" and kw.get("solve", "first_order") != "first_order"):
            raise Unsupported(f"FlexAttention hard-wires the softmax normalisation: {self.spec.label} cannot be "
                              f"written as a score_mod / block mask")
        if problem.device.type != "cuda":
            raise Unsupported("FlexAttention is benchmarked on CUDA only (it has no backward on CPU)")
        from torch.nn.attention.flex_attention import create_block_mask

        from ..ops.kernels.flex import compiled_flex_attention
        causal = self.spec.causal(problem.causal)
        q, k, v = qkv(problem)
        s = problem.shape
        scale = s.head_dim ** -0.5
        alpha = float(kw.get("alpha", 1.0))
        # one compiled function per process (not per row): a new shape, score_mod or mode recompiles
        # it (the runner raises dynamo's recompile limits), the compiled kernels of earlier rows stay cached
        compiled = compiled_flex_attention()
        block_mask = None
        if causal:
            shift = s.nk - s.seq_q
            block_mask = create_block_mask(lambda b, h, qi, kj: kj <= qi + shift, None, None, s.seq_q, s.nk,
                                           device=problem.device)

        extra, extra_leaves = self.flavour.inputs(problem)
        term = FLEX_TERMS[self.flavour.name](problem, **extra) if self.flavour.name in FLEX_TERMS else None

        def forward():
            if kernel == "l2":
                # -scale ||q - k||^2 = 2 (scale q.k) - scale ||q||^2 - scale ||k||^2
                qq, kk = (q * q).sum(-1) * scale, (k * k).sum(-1) * scale

                def variant_mod(score, b, h, qi, kj):
                    return 2 * score - qq[b, h, qi] - kk[b, h, kj]
            elif kernel == "fenchel":
                def variant_mod(score, b, h, qi, kj):
                    return alpha * score
            else:
                variant_mod = None
            score_mod = variant_mod
            if term is not None:
                def score_mod(score, b, h, qi, kj):
                    return term(score if variant_mod is None else variant_mod(score, b, h, qi, kj), b, h, qi, kj)
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
        return Prepared(forward, [q, k, v, *extra_leaves], FLEX,
                        ("flex", self.spec.label, self.flavour.name, problem.key(), causal))


def _t5_term(problem: Problem, relative_bias) -> Callable:
    """The T5 bucketed relative bias of ``relative_bias`` (a T5Bias) as a score_mod term."""
    from ..ops.fenchel.t5_buckets import t5_offset_lut
    s = problem.shape
    lut = t5_offset_lut(s.seq_q, s.nk, relative_bias.num_buckets, relative_bias.max_distance,
                        relative_bias.bidirectional, problem.device)
    table, shift = relative_bias.table, s.seq_q - 1

    def term(score, b, h, qi, kj):
        return score + table[lut[kj - qi + shift], h]
    return term


def _key_bias_term(problem: Problem, attn_mask) -> Callable:
    """A float (B, 1, 1, Nk) mask added to the logits as a score_mod term."""
    def term(score, b, h, qi, kj):
        return score + attn_mask[b, 0, 0, kj]
    return term


# flavour name -> the score_mod term FlexAttention adds for that flavour's inputs
FLEX_TERMS = {"t5": _t5_term, "mask": _key_bias_term}


class FlashAttnTarget(Baseline):
    """flash_attn.flash_attn_func (layout B, N, H, D; fp16/bf16 on CUDA)."""

    def prepare(self, problem: Problem) -> Prepared:
        if not _installed("flash_attn"):
            raise Unavailable("flash-attn is not installed (pip install flash-attn)")
        if problem.device.type != "cuda" or problem.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported("flash-attn runs fp16/bf16 on CUDA only")
        from flash_attn import flash_attn_func
        causal = self.spec.causal(problem.causal)
        q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(problem.needs_grad) for t in qkv(problem))

        def forward():
            return flash_attn_func(q, k, v, causal=causal)
        return Prepared(forward, [q, k, v], FLASH_ATTN, ("flash-attn", problem.key(), causal))


class FlaTarget(Baseline):
    """flash-linear-attention's chunked causal linear attention (layout B, N, H, D) on phi(q), phi(k)."""

    def prepare(self, problem: Problem) -> Prepared:
        if not _installed("fla"):
            raise Unavailable("flash-linear-attention (fla) is not installed (pip install flash-linear-attention)")
        causal = self.spec.causal(problem.causal)
        if not causal:
            raise Unsupported("flash-linear-attention's chunk kernels are causal only")
        if problem.device.type != "cuda":
            raise Unsupported("flash-linear-attention's Triton kernels need a CUDA GPU")
        from fla.ops.linear_attn import chunk_linear_attn
        feature_map = self.spec.kernel_kwargs.get("feature_map", "elu")
        phi = {"elu": lambda x: F.elu(x) + 1.0, "relu": torch.relu, "identity": lambda x: x}[feature_map]
        q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(problem.needs_grad) for t in qkv(problem))

        def forward():
            return chunk_linear_attn(q=phi(q), k=phi(k), v=v, scale=1.0, normalize=feature_map != "identity")[0]
        return Prepared(forward, [q, k, v], FLA, ("fla", self.spec.label, problem.key()))


class TorchMhaTarget(Baseline):
    """torch.nn.MultiheadAttention (batch_first, same shapes) against attnzoo.MultiheadAttention."""

    def prepare(self, problem: Problem) -> Prepared:
        if self.spec.kernel != "softmax":
            raise Unsupported("torch.nn.MultiheadAttention computes softmax attention only")
        s = problem.shape
        embed = s.heads * s.head_dim
        causal = self.spec.causal(problem.causal)
        torch.manual_seed(problem.seed)
        module = torch.nn.MultiheadAttention(embed, s.heads, batch_first=True, device=problem.device,
                                             dtype=problem.dtype)
        x = randn(problem, (s.batch, s.seq_q, embed), 5)
        mask = None
        if causal:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(s.seq_q, device=problem.device,
                                                                        dtype=problem.dtype)

        def forward():
            return module(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]
        return Prepared(forward, [x, *module.parameters()], TORCH_MHA, ("torch-mha", problem.key(), causal))


class SdpaExtrasTarget(Baseline):
    """SDPA computing a spec's softcap / sinks / window with the same dense mask (logit_extras.sdpa)."""

    def prepare(self, problem: Problem) -> Prepared:
        return logit_extras.sdpa(self.spec, problem, self.backend)


class FlexExtrasTarget(Baseline):
    """FlexAttention computing a spec's softcap / sinks / window with the same mods (logit_extras.flex)."""
    compiles = True

    def prepare(self, problem: Problem) -> Prepared:
        return logit_extras.flex(self.spec, problem, self.backend)


def sdpa_names(device: torch.device) -> list[str]:
    return [SDPA, *(_CPU_SDPA if torch.device(device).type == "cpu" else _SDPA_BACKENDS)]


# the variants a FlexAttention score_mod is tried for (those it cannot express record why)
FLEX_TRIED = ("softmax", "l2", "fenchel", "sigmoid", "relu", "sinkhorn")


def baseline_targets(spec: VariantSpec, device: torch.device, backends: Optional[list[str]] = None) -> list[Baseline]:
    """The baselines that compete with ``spec`` (each recorded, even when unavailable or unsupported):
    for a module-level wrapper, torch's own module; for a kernel, the libraries that compute it."""
    out: list[Baseline] = []
    if spec.timed_module is not None:
        out.append(TorchMhaTarget(spec, TORCH_MHA))
    elif extras_of(spec):
        # softcap / sinks / a window: the baselines that compute the same attention (a plain SDPA or
        # Flex row would time another one)
        if spec.kernel == "softmax" and not spec.kernel_kwargs:
            out += [SdpaExtrasTarget(spec, SDPA), FlexExtrasTarget(spec, FLEX)]
    else:
        plain_softmax = spec.kernel == "softmax" and not spec.kernel_kwargs
        if plain_softmax:
            out += [SdpaTarget(spec, n) for n in sdpa_names(device)]
        if spec.kernel in FLEX_TRIED:
            out.append(FlexTarget(spec, FLEX))
        if plain_softmax:
            out.append(FlashAttnTarget(spec, FLASH_ATTN))
        if spec.kernel == "linear":
            out.append(FlaTarget(spec, FLA))
    if backends:
        out = [t for t in out if t.backend in backends]
    return out


def anchor(causal: bool) -> SdpaTarget:
    """SDPA softmax with default dispatch: the denominator of every "x SDPA" ratio."""
    return SdpaTarget(parse_variant("masked" if causal else "softmax"), SDPA)
