"""attnzoo.swap / attnzoo.plan_swap / attnzoo.unswap: walk a model, find its attention modules, swap them.

Every change is planned first (new modules built, kwargs checked) and applied only when all plans
succeeded, so an unknown variant, a bad keyword argument or (strict=True) an unsupported module leaves
the model untouched.
"""
from __future__ import annotations

import warnings
from typing import Optional

from torch import nn

from . import filters, hf, timm, torch_nn
from .report import SwapEntry, SwapReport
from .spec import resolve

ADAPTERS = (hf, torch_nn, timm)


def _adapter_for(module: nn.Module):
    for adapter in ADAPTERS:
        if adapter.recognises(module):
            return adapter
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Attention" in name or "Attn" in name or name.endswith("MHA")


def _inside(name: str, roots: list[str]) -> bool:
    return any(r == "" or name == r or name.startswith(r + ".") for r in roots)


def _walk(model: nn.Module):
    """(recognised [(name, module, adapter)], unrecognised attention-looking [(name, module)])."""
    found, others = [], []
    for name, module in model.named_modules():
        if _inside(name, [n for n, _, _ in found]) and found:
            continue  # inside an attention module already found (its kernel, its projections)
        adapter = _adapter_for(module)
        if adapter is not None:
            found.append((name, module, adapter))
        elif _looks_like_attention(module):
            others.append((name, module))
    roots = [n for n, _, _ in found]
    # containers of a recognised module (HF's BertAttention around BertSelfAttention) are not attention
    others = [(n, m) for n, m in others
              if not _inside(n, roots) and not any(_inside(r, [n]) for r in roots)]
    return found, others


def _unsupported_reason(module: nn.Module, adapter) -> Optional[str]:
    if adapter is not None:
        return adapter.unsupported_reason(module)
    return timm.unsupported_reason(module) or "no attnzoo adapter knows this class's layout"


def plan_swap(model: nn.Module, spec: str, *, include=None, exclude=None, strict: bool = False,
              **variant_kwargs) -> SwapReport:
    """Dry run of ``swap``: the report of what it would change; the model is not modified."""
    report, _ = _plan(model, spec, include, exclude, strict, variant_kwargs, dry_run=True)
    return report


def _plan(model, spec, include, exclude, strict, variant_kwargs, dry_run):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    target = resolve(spec, variant_kwargs)
    include = filters.normalise(include, "include")
    exclude = filters.normalise(exclude, "exclude")
    found, others = _walk(model)
    report = SwapReport(spec=spec, dry_run=dry_run)
    changes = []
    for name, module, adapter in found:
        ok, why = filters.selected(name, include, exclude)
        if not ok:
            report.entries.append(SwapEntry(name, "excluded", type(module).__name__, reason=why))
            continue
        reason = _unsupported_reason(module, adapter) or (
            "the model itself is this attention module; swap the model that contains it" if name == "" else None)
        if not reason and hasattr(adapter, "unsupported_for"):  # what the module needs of this variant
            reason = adapter.unsupported_for(module, target)
        if reason:
            report.entries.append(SwapEntry(name, "unsupported", type(module).__name__, reason=reason))
            continue
        change = adapter.plan(model, name, module, target)
        changes.append(change)
        report.entries.append(SwapEntry(name, "swap", change.source, change.target, list(change.carried),
                                        list(change.added), list(change.dropped)))
    for name, module in others:
        if filters.selected(name, include, exclude)[0]:
            report.entries.append(SwapEntry(name, "unsupported", type(module).__name__,
                                            reason=_unsupported_reason(module, None)))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    report.entries.sort(key=lambda e: order.get(e.name, -1))  # model order, whatever the adapter
    if not dry_run:  # a dry run only reports
        _complain(report, strict)
    return report, changes


def _complain(report: SwapReport, strict: bool) -> None:
    if report.unsupported:
        details = "; ".join(f"{e.name} ({e.source}: {e.reason})" for e in report.entries if e.action == "unsupported")
        message = f"attnzoo.swap: attention modules left unchanged because they are unsupported: {details}"
        if strict:
            raise ValueError(message + " (strict=True; pass exclude= to skip them)")
        warnings.warn(message, stacklevel=4)
    if not report.swapped:
        message = "attnzoo.swap found no attention module it can swap" + (
            " (check include=/exclude=)" if report.excluded else "")
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=4)


def swap(model: nn.Module, spec: str, *, include=None, exclude=None, strict: bool = False,
         dry_run: bool = False, **variant_kwargs):
    """Replace every attention module of ``model`` that attnzoo recognises by the ``spec`` variant, in
    place, keeping the weights that carry over; returns ``model`` (``dry_run=True``: returns the
    SwapReport and changes nothing). The report of the last swap is ``model.attnzoo_swap_report``.

    spec: a variant name or spec string (``"sinkhorn(n_iters=5)"``); keyword arguments override it.
    include / exclude: glob or regex patterns (or lists of them) on module names, e.g.
        ``include="blocks.11.*"`` swaps only the last block of a 12-block ViT.
    strict: raise ValueError (before changing anything) if a selected attention module is unsupported
        or nothing matched; default False warns and lists them in the report (a dry run only reports).
    """
    report, changes = _plan(model, spec, include, exclude, strict, variant_kwargs, dry_run)
    if dry_run:
        return report
    for change in changes:
        change.apply()
    torch_nn.sync_nested_tensor_flags(model)
    torch_nn.sync_decoder_hooks(model)
    object.__setattr__(model, "attnzoo_swap_report", report)
    return model


def unswap(model: nn.Module, *, include=None, exclude=None, dry_run: bool = False):
    """Swap attnzoo attention back to the module type it replaced (timm Attention, nn.MultiheadAttention,
    the HF model's own implementation), moving the carried weights back; parameters the variant added
    are dropped (listed in the report). Returns ``model`` (``dry_run=True``: the SwapReport)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    include = filters.normalise(include, "include")
    exclude = filters.normalise(exclude, "exclude")
    found, _ = _walk(model)
    report = SwapReport(spec="unswap", dry_run=dry_run)
    changes = []
    for name, module, adapter in found:
        change = adapter.revert(model, name, module)
        if change is None:
            continue
        ok, why = filters.selected(name, include, exclude)
        if not ok:
            report.entries.append(SwapEntry(name, "excluded", type(module).__name__, reason=why))
            continue
        changes.append(change)
        report.entries.append(SwapEntry(name, "unswap", change.source, change.target, list(change.carried),
                                        list(change.added), list(change.dropped)))
    if dry_run:
        return report
    for change in changes:
        change.apply()
    torch_nn.sync_nested_tensor_flags(model)
    torch_nn.sync_decoder_hooks(model)
    hf.restore_implementations(model)
    object.__setattr__(model, "attnzoo_swap_report", report)
    return model
