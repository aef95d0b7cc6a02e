"""A config keyword declared with its documentation, where the code that validates it lives.

Why: the keyword reference (``docs/keywords.md``, written by ``zero-offload keywords``) is read
from these declarations, so a keyword cannot be added, renamed or given a new default without
its documentation following; a test fails when a keyword has no doc or the page is stale.
This module imports nothing of the package, so every config section can use it.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, TypeVar

__all__ = ["keyword", "keyword_doc"]

_T = TypeVar("_T")


def keyword(default: _T, doc: str, *, shown: str | None = None) -> _T:
    """A dataclass field whose user-facing documentation is ``doc`` (Markdown, one paragraph).

    ``shown`` replaces the default in the reference where its value alone would mislead
    (``None`` standing for a size computed at run time, say).
    """
    return field(default=default, metadata={"doc": doc, "shown": shown})


def keyword_doc(f: Any) -> tuple[str, str | None]:
    """A dataclass field's ``(doc, shown)``; an empty doc when it was declared without one."""
    return f.metadata.get("doc", ""), f.metadata.get("shown")
