"""include=/exclude= patterns: a glob (fnmatch) or a regular expression, matched against a module's
qualified name or any enclosing module's name (so ``"blocks.11"`` selects ``blocks.11.attn``)."""
from __future__ import annotations

import fnmatch
import re
from typing import Iterable, Optional, Union

Pattern = Union[str, "re.Pattern[str]"]


def normalise(patterns, argument: str) -> Optional[list]:
    if patterns is None:
        return None
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    try:
        patterns = list(patterns)
    except TypeError:
        raise TypeError(f"{argument} must be a pattern string, a compiled regex or a list of them, "
                        f"got {type(patterns).__name__}") from None
    for p in patterns:
        if not isinstance(p, (str, re.Pattern)):
            raise TypeError(f"{argument} patterns must be strings or compiled regexes, got {p!r}")
    return patterns


def _one(pattern, name: str) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(name) is not None
    if fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:  # a glob such as "*.attn" is not a valid regex
        return False


def _self_and_ancestors(name: str) -> Iterable[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def matches(patterns: Optional[list], name: str) -> bool:
    return any(_one(p, n) for p in patterns for n in _self_and_ancestors(name))


def selected(name: str, include: Optional[list], exclude: Optional[list]) -> tuple[bool, str]:
    if include is not None and not matches(include, name):
        return False, "not matched by include="
    if exclude is not None and matches(exclude, name):
        return False, "matched by exclude="
    return True, ""
