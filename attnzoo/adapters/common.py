"""What every adapter shares: a planned change, and the bookkeeping of carried/added parameters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

ORIGIN_ATTR = "_attnzoo_origin"   # plain attribute on a swapped module: the class to swap back to


@dataclass
class Change:
    """One planned edit. ``apply`` performs it; nothing in the model changes before every change of a
    swap has been planned (and every new module built) without error."""
    name: str
    source: str                    # class name before
    target: str                    # class name after
    carried: list[str] = field(default_factory=list)   # parameter names moved over unchanged
    added: list[str] = field(default_factory=list)     # new parameter names (with their initialisation)
    dropped: list[str] = field(default_factory=list)   # parameters that do not exist after the change
    apply: Optional[Callable[[], None]] = None


def param_names(module: Optional[nn.Module], prefix: str = "") -> list[str]:
    if module is None:
        return []
    return [prefix + n for n, _ in module.named_parameters()]


def set_origin(module: nn.Module, cls: type) -> None:
    object.__setattr__(module, ORIGIN_ATTR, cls)


def get_origin(module: nn.Module) -> Optional[type]:
    return getattr(module, ORIGIN_ATTR, None)


def replace_child(root: nn.Module, name: str, new: nn.Module) -> Callable[[], None]:
    """A closure that puts ``new`` where ``root.get_submodule(name)`` is."""
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root

    def apply() -> None:
        setattr(parent, attr, new)
    return apply


def exchange(root: nn.Module, name: str, old: nn.Module, new: nn.Module,
             move: Callable[[nn.Module, nn.Module], None]) -> Callable[[], None]:
    """A closure that moves ``old``'s weights into ``new`` (``move``), gives ``new`` the train/eval mode
    of ``old`` and puts it where ``old`` is."""
    def apply() -> None:
        move(old, new)
        new.train(old.training)
        replace_child(root, name, new)()
    return apply


def describe_new_parameters(layer: nn.Module, skip: set[str]) -> list[str]:
    """'name (init)' for each parameter of ``layer`` the host did not provide."""
    out = []
    for n, p in layer.named_parameters():
        if n in skip:
            continue
        if bool((p == 0).all()):
            init = "zeros"
        elif bool((p == 1).all()):
            init = "ones"
        else:
            init = "default init"
        out.append(f"{n} {tuple(p.shape)} [{init}]")
    return out
