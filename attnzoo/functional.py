"""attnzoo.functional: one function per attention variant, laid out like
``F.scaled_dot_product_attention``: q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv) ->
(B, H, Nq, Dv).

Shared arguments: ``attn_mask`` (bool, True = take part, or float added to the logits; broadcastable
to (B, H, Nq, Nk)), ``is_causal`` (key j takes part for query i when j <= i + Nk - Nq: bottom-right
aligned, see ``ops.masking.causal_keep``), ``scale`` (default 1/sqrt(D)), ``dropout_p`` (on the
attention weights, like SDPA: pass 0 at eval) and ``backend`` (``"auto"`` by default, see
``attnzoo.explain``). A query row left with no key returns zeros.

Each variant lives in ``attnzoo/ops/<variant>/``: its math in ``reference.py``, its function in
``functional.py`` (re-exported here), its kernels and their registration as backends, and its record
(``ops/variant.py``). ``VARIANT_FUNCTIONS`` maps every declared variant, those registered with
``attnzoo.register_variant`` included, to its function.

Masks, biases and preferences of fewer than 4 dims are read as broadcast from the right (like
SDPA) and handed to every backend as 4-D views (no copy). A float mask, ``log_u`` or a tensor
``bias`` holding NaN or +inf is a ValueError naming the argument (checked in eager mode on CPU
tensors; see ``ops/validate.py`` for why not on CUDA by default). NaN in q, k or v propagates to
the output rows it takes part in. A batch or head count of 0 gives an empty output.
"""
from __future__ import annotations

from collections.abc import Mapping

from .ops import builtin  # noqa: F401  (declares the built-in variants)
from .ops import dispatch
from .ops import variant as catalog
from .ops import validate as V
from .ops.fenchel.functional import fenchel
from .ops.l2.functional import l2
from .ops.linear.functional import linear
from .ops.ot.functional import ot
from .ops.relu.functional import relu
from .ops.sigmoid.functional import sigmoid
from .ops.sinkhorn.functional import sinkhorn
from .ops.softmax.functional import softmax
from .ops.varlen import attend_varlen


class _VariantFunctions(Mapping):
    """Variant name -> its public function, for every declared variant (read at each access)."""

    def __getitem__(self, name):
        if not catalog.is_declared(name):
            raise KeyError(name)
        return catalog.get(name).functional

    def __iter__(self):
        return iter(catalog.names())

    def __len__(self):
        return len(catalog.names())

    def __repr__(self):
        return f"VARIANT_FUNCTIONS({catalog.names()})"


VARIANT_FUNCTIONS: Mapping = _VariantFunctions()


def masked(q, k, v, attn_mask=None, scale=None, *, kind="softmax", **kwargs):
    """Causal (masked) attention with any kernel: ``kind``'s function with is_causal=True."""
    V.check_choice("kind", kind, catalog.names())
    return catalog.get(kind).functional(q, k, v, attn_mask=attn_mask, is_causal=True, scale=scale, **kwargs)


def varlen(variant: str, q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, *, is_causal=False, scale=None,
           dropout_p=0.0, backend=None, enable_gqa=False, **options):
    """Packed sequences, ``torch.nn.attention.varlen.varlen_attn``'s layout: ``variant``'s attention on
    q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv), sequence i being rows
    cu_seq_q[i]:cu_seq_q[i+1] of q and cu_seq_k[i]:cu_seq_k[i+1] of k and v (int32 offsets, N + 1;
    ``cu_seq_k=None``: the same as q's), each its own attention problem. ``options`` are the
    variant's (``n_iters=``, ``bias=``, ...). See ``attnzoo/ops/varlen.py``."""
    return attend_varlen(variant, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal, scale=scale,
                         dropout_p=dropout_p, backend=backend, enable_gqa=enable_gqa, **options)


def explain(variant: str, q, k, v, backend=None, **kwargs) -> dispatch.Choice:
    """Which kernel runs this call and why the others were skipped; ``print()`` it."""
    return catalog.explain(variant, q, k, v, backend=backend, **kwargs)


__all__ = ["softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "fenchel", "ot", "masked", "varlen", "explain",
           "VARIANT_FUNCTIONS"]
