"""Paper 004's Fenchel dual on real attention layers.

The exact maximiser lambda* of dual (7) is attnzoo.ops.fenchel.reference.solve_dual (damped Newton,
float64), the solver behind ``fenchel(solve="exact")``; this module only reads it. Reading of an
attention layer (design.md): templates t_j = keys k_j, evidence z_i = scale * q_i, preference u_ij
uniform over the keys taking part (or exp(log_u)). The first-order solution (14) is alpha z_i,
which is what the layer computes; Fig 4 of paper 004 plots ||lambda* - alpha z|| / ||lambda*||.

``relative_deviation`` computes it for given q, k; ``model_deviation`` hooks every attention layer
of a model (timm ``Attention`` or any attnzoo layer: both expose ``qkv``, ``num_heads``,
``q_norm``, ``k_norm`` and ``scale``) and returns the values per layer and head.
"""
from __future__ import annotations

import torch

from ..ops.fenchel.reference import _second_order_lambda, preference_log_weights, solve_dual
from ..ops.masking import masked_softmax


def dual_lambdas(q, k, *, scale, alpha=1.0, log_u=None, attn_mask=None, is_causal=False):
    """(lambda_exact, lambda_first, lambda_second), each (B, H, Nq, D), float64."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must be (B, H, N, D) with the same D, got {tuple(q.shape)} and {tuple(k.shape)}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    q, k = q.double(), k.double()
    keep, log_u_full = preference_log_weights(None if log_u is None else log_u.double(), attn_mask, is_causal, q, k)
    shape = q.shape[:-1] + (k.shape[-2],)
    z = q * scale
    lam = solve_dual(log_u_full.expand(shape), keep, k, z, alpha)
    u = masked_softmax(log_u_full.expand(shape), keep)
    lam2 = _second_order_lambda(u, k, z, alpha)[0]
    return lam, alpha * z, lam2


def relative_deviation(q, k, *, scale, alpha=1.0, **kw):
    """||lambda* - alpha z|| / ||lambda*|| per query, shape (B, H, Nq) (paper 004 Fig 4)."""
    lam, lam1, _ = dual_lambdas(q, k, scale=scale, alpha=alpha, **kw)
    return (lam - lam1).norm(dim=-1) / lam.norm(dim=-1).clamp_min(1e-300)


def attention_modules(model):
    """[(name, module)] for every attention layer with timm's qkv interface."""
    out = []
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ("qkv", "num_heads", "scale")) and isinstance(getattr(m, "qkv"), torch.nn.Linear):
            out.append((name, m))
    return out


def _qk(module, x):
    B, N, _ = x.shape
    H = module.num_heads
    qkv = module.qkv(x)
    hd = qkv.shape[-1] // (3 * H)
    q, k, _ = qkv.reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
    q = module.q_norm(q) if hasattr(module, "q_norm") else q
    k = module.k_norm(k) if hasattr(module, "k_norm") else k
    return q, k


@torch.no_grad()
def model_deviation(model, batches, *, alpha=1.0, max_queries=None, progress=False):
    """Run ``model`` on every batch in ``batches`` (tensors fed as model(batch)) and return
    {layer name: tensor (H, n_values)} of ||lambda* - alpha z|| / ||lambda*|| per head."""
    mods = attention_modules(model)
    if not mods:
        raise ValueError("model has no attention layer with a qkv projection (timm Attention or attnzoo layer)")
    store = {name: [] for name, _ in mods}
    hooks = []
    for name, m in mods:
        def hook(module, args, kwargs, name=name):
            x = args[0] if args else kwargs["x"]
            q, k = _qk(module, x)
            if max_queries is not None:
                q = q[..., :max_queries, :]
            r = relative_deviation(q, k, scale=float(module.scale), alpha=alpha)   # (B, H, Nq)
            store[name].append(r.permute(1, 0, 2).reshape(r.shape[1], -1))
        hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        it = batches
        if progress:
            from tqdm import tqdm
            it = tqdm(batches, desc="fenchel dual", leave=False)
        for xb in it:
            model(xb)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {name: torch.cat(v, dim=1) for name, v in store.items()}
