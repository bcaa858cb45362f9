"""Dotted module-path patterns, as tensor-parallel plans and adapter targets write them: each component matched with
shell wildcards (`*`, `?`, `[qkv]`), and `**` standing for any number of components."""

from __future__ import annotations

import fnmatch


def match(pattern: str, path: str) -> bool:
    """Whether the dotted module `path` matches `pattern` (`*` one component, `**` any number)."""

    def rec(pat: list[str], parts: list[str]) -> bool:
        if not pat:
            return not parts
        if pat[0] == "**":
            return any(rec(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and rec(pat[1:], parts[1:])

    return rec(pattern.split("."), path.split("."))
