"""What torch.compile's inductor believes each attnzoo Triton kernel writes, computed on a CPU.

Under torch.compile every Triton launch becomes a functional graph node, and inductor decides which
of its tensor arguments the kernel mutates by reading the kernel's Triton IR
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``). When that analysis cannot
follow a store or atomic address it marks inputs as written too: harmless for a scratch tensor,
wrong-footing for a saved input of a backward or a parameter (so the T5 table's atomics take their
addresses straight from loads).

Run as ``python -m tests.mutation_probe`` with TRITON_INTERPRET unset (the analysis needs real
``JITFunction``s). No GPU is needed: Triton's IR is generated for an sm_90 target, launches are
recorded instead of run (the outputs are garbage, only the arguments matter), and the host-side
"needs a GPU" checks are switched off. Prints one JSON object: {"module.kernel": [written args]}.
"""
from __future__ import annotations

import importlib
import json

import torch


def _record_launches():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(_Sm90())
    launches = []

    def record(kernel, grid):
        return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

    JITFunction.__getitem__ = record  # wrap_triton(kernel)[grid](...) ends here too when not tracing
    Autotuner.__getitem__ = record  # autotuned kernels: the analysis reads their first config's IR
    return launches


def _allow_cpu_tensors():
    def ok(*args, **kwargs):
        return None

    for name in ("attnzoo.ops.kernels.flash_softmax.triton", "attnzoo.ops.kernels.pointwise.triton", "attnzoo.ops.sinkhorn.triton",
                 "attnzoo.ops.linear.triton", "attnzoo.ops.ot.triton"):
        module = importlib.import_module(name)
        for check in ("device_reason", "common_reason", "unsupported_reason", "_check_runnable", "_check"):
            if hasattr(module, check):
                setattr(module, check, ok)


def _cases():
    from attnzoo.ops.linear.triton import linear_attention_triton
    from attnzoo.ops.ot.triton import ot_attention_triton
    from attnzoo.ops.ot.varlen import ot_varlen_triton
    from attnzoo.ops.kernels.pointwise import triton as pointwise
    from attnzoo.ops.sinkhorn.triton import sinkhorn_attention
    from attnzoo.ops.fenchel.t5 import t5_bias_attention
    from attnzoo.ops.kernels.flash_softmax import triton as fused
    from attnzoo.ops.kernels.flash_softmax import varlen as fused_varlen
    from attnzoo.ops.kernels.pointwise import varlen as pointwise_varlen
    from attnzoo.ops.sinkhorn import varlen as sinkhorn_varlen

    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(True)

    q, k, v = leaf(1, 2, 37, 16), leaf(1, 2, 37, 16), leaf(1, 2, 37, 16)
    half = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    bool_mask = torch.rand(1, 1, 37, 37, generator=g) > 0.3
    float_mask = torch.randn(1, 1, 37, 37, generator=g)
    # packed sequences of 5, 20 and 12 tokens (T, H, D): the varlen launches, whose base addresses come
    # from loaded offsets
    packed = [leaf(37, 2, 16) for _ in range(3)]
    cu = torch.tensor([0, 5, 25, 37], dtype=torch.int32)
    return {
        "softmax": lambda: fused.softmax_attention(q, k, v, attn_mask=float_mask, is_causal=True, scale=0.25),
        "l2": lambda: fused.l2_attention(q, k, v, attn_mask=bool_mask, scale=0.25),
        "preference": lambda: fused.preference_attention(q, k, v, leaf(1, 2, 37), is_causal=True),
        "t5+dropout": lambda: t5_bias_attention(q, k, v, leaf(8, 2), 8, 20, True, attn_mask=bool_mask,
                                                      dropout_p=0.1),
        "sigmoid+bias+dropout": lambda: pointwise.sigmoid_attention(
            q, k, v, attn_mask=bool_mask, scale=0.25, bias=leaf(1, 2, 1, 1), dropout_p=0.1),
        "relu": lambda: pointwise.relu_attention(q, k, v, is_causal=True, scale=0.25),
        "softmax-varlen": lambda: fused_varlen.attention(*packed, cu, cu, 20, 20, scale=0.25, is_causal=True),
        "sigmoid-varlen": lambda: pointwise_varlen.attention(*packed, cu, cu, 20, 20, scale=0.25, sigmoid=True),
        "sinkhorn": lambda: sinkhorn_attention(q, k, v, attn_mask=bool_mask, scale=0.25, n_iters=2),
        "sinkhorn-varlen": lambda: sinkhorn_varlen.attention(*packed, cu, cu, 20, 20, scale=0.25, n_iters=2, eps=1.0,
                                                             cost="l2"),
        "sinkhorn-implicit": lambda: sinkhorn_attention(q, k, v, scale=0.25, n_iters=2, grad_mode="implicit"),
        # a window: every pass walks only its band's tiles (BAND), g^0 and delta computed before the passes
        "sinkhorn-window": lambda: sinkhorn_attention(q, k, v, scale=0.25, n_iters=2, window_size=(5, 2)),
        "linear-causal": lambda: linear_attention_triton(q, k, v, is_causal=True),
        # half inputs: the attend / output kernels also write the unrounded output (issue 21)
        "sinkhorn-bf16": lambda: sinkhorn_attention(*half, scale=0.25, n_iters=2),
        "linear-causal-bf16": lambda: linear_attention_triton(*half, is_causal=True),
        "t5-bf16": lambda: t5_bias_attention(*half, leaf(8, 2), 8, 20, True, attn_mask=bool_mask),  # + ORES
        # 2100 keys: the key reduction is split (and summed); a float key mask that needs its gradient
        "linear-noncausal": lambda: linear_attention_triton(q, leaf(1, 2, 2100, 16), leaf(1, 2, 2100, 16),
                                                            attn_mask=leaf(2100), is_causal=False),
        "ot+templates": lambda: ot_attention_triton(q, k, v, scale=0.25, templates_k=leaf(1, 2, 5, 16),
                                                    templates_v=leaf(1, 2, 5, 16)),
        # causal: the exp kernel writes each query's kept-key range (tile skipping, issue 21)
        "ot-causal": lambda: ot_attention_triton(q, k, v, scale=0.25, is_causal=True),
        "ot-varlen": lambda: ot_varlen_triton(*packed, cu, cu, 20, 20, is_causal=True, alpha=1.0, gamma=4.0),
    }


def main() -> None:
    launches = _record_launches()
    _allow_cpu_tensors()
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
    from triton.runtime.autotuner import Autotuner

    from attnzoo.ops.triton_utils import packed_defaults

    writes: dict[str, set] = {}
    for name, call in _cases().items():
        launches.clear()
        out = call()
        out.float().sum().backward()
        if not launches:
            raise RuntimeError(f"case {name!r} launched no Triton kernel")
        for kernel, args, kwargs in launches:
            # what a launch under torch.compile passes (ops/triton_utils.launcher adds the packed defaults)
            kwargs = {**packed_defaults(kernel, len(args), kwargs), **kwargs}
            arguments = {**dict(zip(kernel.arg_names, args)), **kwargs}
            accessed = identify_accessed_tensors(kernel, arguments, {})
            jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
            key = f"{jit.fn.__module__}.{jit.fn.__name__}"
            writes.setdefault(key, set()).update(dep.name for dep in accessed.read_writes.writes)
    print(json.dumps({key: sorted(names) for key, names in sorted(writes.items())}))


if __name__ == "__main__":
    main()
