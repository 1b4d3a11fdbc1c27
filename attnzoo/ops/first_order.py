"""Backwards that have no backward of their own: asking for a double backward through them is an
error, not a silently wrong second derivative.

A hand-written backward (Triton launches, the streaming Sinkhorn passes) computes its gradients with
operations autograd does not see as functions of the inputs. Under ``create_graph=True`` (a gradient
penalty, a Hessian-vector product) the gradients it returned looked constant in q, k, v, or carried
only the few differentiable steps around the kernels (the linear and OT Triton backwards), so the
second derivative came out wrong without a word. torch's ``once_differentiable`` would not cover it:
its error node hangs off fresh leaves and is reached only when an incoming gradient requires grad, so
``grad(grad(out.sum(), q, create_graph=True)[0].sum(), q)`` still drops the term; and the saved
inputs that could tie such a node to q cannot be read twice under activation checkpointing (causal
Sinkhorn's prefixes). So the backward refuses create_graph outright.
"""
from __future__ import annotations

import functools

import torch


def first_order_only(backward, name: str):
    """``backward(ctx, *grads)`` that raises a RuntimeError naming ``name`` and the way out when run
    with create_graph=True (grad mode is on inside a backward exactly then)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{name} computes its gradient in kernels that autograd cannot differentiate again: double "
                "backward (create_graph=True) is not supported on this backend; use backend='reference', "
                "whose eager formula autograd differentiates twice")
        return backward(ctx, *grads)

    return wrapper
