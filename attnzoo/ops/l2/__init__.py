"""L2 attention: softmax_j(-scale ||q_i - k_j||^2 + mask_ij) v_j (paper 002 sec 2.3; Kim et al. 2021).

Backends: "reference"; "triton", the online-softmax kernel with row/column norms (priority 20);
"torch", SDPA on q, k augmented by one coordinate (15: below Triton on CUDA, above the blockwise
path on CPU); "cpu", the blockwise path (10); "flex", FlexAttention with an L2 score_mod (5, CUDA:
auto picks it only when Triton and SDPA decline). The shared kernels are in ops/kernels/; the L2
forms of them in kernels.py.
"""
from __future__ import annotations

from ..dispatch import register_backend
from ..kernels import blockwise, blockwise_varlen, sdpa
from ..kernels.flash_softmax import bound as flash_bound
from ..kernels.flash_softmax import triton as flash
from ..kernels.flex import flex_reason
from ..triton_utils import register_triton
from .. import varlen_triton
from ..catalog import declare
from ..record import Variant
from .functional import l2
from .backends import l2_cpu, l2_cpu_varlen, l2_flex, l2_torch, l2_triton_varlen
from .layer import L2Hook
from .reference import l2_attention

register_triton("l2", flash.l2_attention, gqa=True, specialize=flash_bound.specializer(l2=True),
                description="Triton fused L2 softmax (-scale ||q-k||^2 via row/column norms), fwd+bwd, in-kernel dropout",
                extras=flash.FUSED_EXTRAS)
sdpa.register("l2", l2_torch, priority=15, gqa=True, description=sdpa.DESCRIPTION + ", q and k augmented by one coordinate")
blockwise.register("l2", l2_cpu)
blockwise_varlen.register("l2", l2_cpu_varlen)
varlen_triton.register("l2", l2_triton_varlen)
register_backend("l2", "flex", l2_flex, supports=flex_reason, priority=5,
                 description="FlexAttention with an L2 score_mod (CUDA)", auto_devices=("cuda",),
                 extras=("softcap", "sinks", "window_size"))

RECORD = declare(Variant(
    name="l2", reference=l2_attention, functional=l2, hook=L2Hook(), class_name="L2Attention",
    extras=frozenset({"softcap", "sinks"}),
    doc=("softmax(-||q - k||^2 / sqrt(d)) v. ``tie_qk=True`` uses W_Q (and its bias) for the keys too, Kim et "
         "al.'s Lipschitz form; the qkv weight keeps its shape so timm checkpoints still load."),
    complexity="O(N^2 D)", parameters="tie_qk=True ties W_Q = W_K", paper="paper 002 sec 2.3; Kim et al. 2021",
))
