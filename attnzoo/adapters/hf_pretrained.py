"""``attnzoo.from_pretrained(ModelClass, path, **kwargs)``: load a Hugging Face model saved after
``attnzoo.swap`` with its variants and their learned parameters.

transformers builds and loads the model (every option of its ``from_pretrained`` works: dtype,
device_map, revision, ...); its config carries the swaps (``hf_record``); each recorded spec is swapped
in again on the recorded modules, then the kernels' parameters and buffers are read from the saved
safetensors files. transformers' load report, which would list those as UNEXPECTED, is shown only
when something else is amiss.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager

from torch import nn

from . import hf_record
from .hf import KERNEL_CHILD, recognises
from .swap import swap

SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"
_HUB_OPTIONS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


class _HeldReport(logging.Filter):
    """Holds back transformers' load report during the load; ``release`` shows it when it still says more
    than the kernels' keys."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, rec: logging.LogRecord) -> bool:
        if "LOAD REPORT" in rec.getMessage():
            self.held.append(rec)
            return False
        return True


@contextmanager
def _holding_report(logger_name: str):
    logger, hold = logging.getLogger(logger_name), _HeldReport()
    logger.addFilter(hold)
    try:
        yield hold
    finally:
        logger.removeFilter(hold)


def _attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if recognises(m)}


def _spellings(name: str, prefix: str) -> list[str]:
    """A name as saved, with transformers' base-model prefix added, and without it (a head model saved,
    its base model loaded, or the other way round)."""
    return [name, f"{prefix}.{name}"] + ([name[len(prefix) + 1:]] if prefix and name.startswith(prefix + ".") else [])


def _in_model(name: str, names: dict, prefix: str) -> str:
    """A recorded module name as it is in the loaded model."""
    for c in _spellings(name, prefix):
        if c in names:
            return c
    raise ValueError(f"the saved config records an attnzoo swap of module {name!r}, which this model has no "
                     "attention module for; load the saved folder with the model class that saved it")


def _records(model: nn.Module) -> dict[str, str]:
    modules, prefix = _attention_modules(model), getattr(model, "base_model_prefix", "")
    found: dict[str, str] = {}
    for config in {id(m.config): m.config for m in modules.values()}.values():
        for name, spec in hf_record.entries(config).items():
            if spec is None:
                raise ValueError(f"module {name!r} was swapped with a spec whose arguments are not literals, "
                                 "which config.json cannot hold; swap it by hand and load the state_dict")
            found[_in_model(name, modules, prefix)] = spec
    return found


def _checkpoint_files(path, hub: dict) -> list[str]:
    from transformers.utils import cached_file
    single = cached_file(path, SAFETENSORS, _raise_exceptions_for_missing_entries=False, **hub)
    if single is not None:
        return [single]
    index = cached_file(path, INDEX, _raise_exceptions_for_missing_entries=False, **hub)
    if index is None:
        raise ValueError(f"{path!r} holds neither {SAFETENSORS} nor {INDEX}; attnzoo.from_pretrained reads "
                         "the kernels' parameters from safetensors files (save_pretrained writes them)")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [cached_file(path, s, **hub) for s in shards]


def _kernel_tensors(files: list[str]) -> dict:
    from safetensors import safe_open
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if f".{KERNEL_CHILD}." in key:
                    out[key] = f.get_tensor(key)
    return out


def _load_kernels(model: nn.Module, path, hub: dict) -> set[str]:
    """Copy the kernels' saved parameters and buffers into the swapped model; returns the checkpoint
    keys used."""
    wanted = [k for k in model.state_dict() if f".{KERNEL_CHILD}." in k]
    if not wanted:
        return set()
    saved, prefix = _kernel_tensors(_checkpoint_files(path, hub)), getattr(model, "base_model_prefix", "")
    state, used, missing = {}, set(), []
    for key in wanted:
        hit = next((o for o in _spellings(key, prefix) if o in saved), None)
        if hit is None:
            missing.append(key)
            continue
        state[key] = saved[hit]
        used.add(hit)
    if missing:
        raise ValueError(f"the saved checkpoint at {path!r} lacks the attnzoo kernels' tensors {missing}: was it "
                         "saved after the swap its config records?")
    model.load_state_dict(state, strict=False)
    return used


def from_pretrained(model_class, path, *args, **kwargs):
    """``model_class.from_pretrained(path, *args, **kwargs)`` (any transformers model or Auto class) for a
    folder or Hub repository saved after ``attnzoo.swap``: the recorded specs are swapped in again and
    their learned parameters loaded, so the model computes what the saved one did. Raises ValueError
    when the saved config records no swap. ``output_loading_info=True`` returns (model, info) as
    transformers does, the kernels' keys no longer listed as unexpected."""
    if not hasattr(model_class, "from_pretrained"):
        raise TypeError("model_class must be a transformers model class or Auto class (e.g. AutoModelForCausalLM), "
                        f"got {model_class!r}")
    want_info = kwargs.pop("output_loading_info", False)
    with _holding_report("transformers.modeling_utils") as hold:
        model, info = model_class.from_pretrained(path, *args, output_loading_info=True, **kwargs)
    records = _records(model)
    if not records:
        for rec in hold.held:
            logging.getLogger(rec.name).handle(rec)
        raise ValueError(f"the config saved at {path!r} records no attnzoo swap (no {hf_record.RECORD!r} entry); "
                         f"load it with {getattr(model_class, '__name__', model_class)}.from_pretrained")
    by_spec: dict[str, list[str]] = {}
    for name, spec in records.items():
        by_spec.setdefault(spec, []).append(name)
    for spec, names in by_spec.items():
        swap(model, spec, include=[re.compile(re.escape(n)) for n in names], strict=True)
    used = _load_kernels(model, path, {k: kwargs[k] for k in _HUB_OPTIONS if k in kwargs})
    info = dict(info)
    info["unexpected_keys"] = {k for k in info.get("unexpected_keys", ()) if k not in used}
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
        for rec in hold.held:
            logging.getLogger(rec.name).handle(rec)
    return (model, info) if want_info else model
