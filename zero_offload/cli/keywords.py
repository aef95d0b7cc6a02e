"""``zero-offload keywords``: the keyword reference, written from the config's own field docs.

``docs/keywords.md`` is this command's output (``zero-offload keywords > docs/keywords.md``);
a test fails when the page differs from it or a keyword has no doc, so the reference follows
the code: a keyword is documented where it is declared (:func:`zero_offload.fields.keyword`).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from ..config import keyword_fields
from ..fields import keyword_doc

_TITLES = {
    "ZeroConfig": "Sharding and the step",
    "OptimizerConfig": "Optimizer",
    "PrecisionConfig": "Precision and loss scaling",
    "OffloadConfig": "Offload",
    "ActivationConfig": "Activations",
}

_HEADER = """\
# Keywords

Every keyword of `zero_offload.initialize(model, **keywords)`. `ZeroOffloadTrainer`'s
`zero_offload=` and `ZeroOffloadStrategy(...)` take the same ones.
The same keys can come as `config=` a dict or a JSON file path (keywords given beside it win),
and a DeepSpeed config is read as DeepSpeed reads it ([deepspeed.md](deepspeed.md);
`zero-offload convert-config ds_config.json` prints the keywords it becomes). Every keyword is
validated before anything is touched: a bad one raises `zo.ConfigError` naming the key, the
value and what is allowed (with "did you mean" for a misspelt key).

This page is generated from the config's own field docs (`zero_offload/config/` and the
sections it holds) by `zero-offload keywords > docs/keywords.md`; edit the docs there."""


def _plain(docstring: str | None) -> str:
    """A class docstring's first paragraph as Markdown (Sphinx roles become code spans)."""
    text = (docstring or "").strip().split("\n\n")[0]
    text = re.sub(r":\w+:`~?\.?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return " ".join(text.replace("``", "`").split())


def _default(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"`{value:_}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, torch.dtype):
        return f"`{value}`"
    return f"`{value!r}`"


_INTROS = {"ZeroConfig": "What is sharded, how updates are made and how stage 3 gathers."}


def markdown() -> str:
    """The whole of ``docs/keywords.md``."""
    out = [_HEADER]
    section = None
    for key, cls, f in keyword_fields():
        if cls is not section:
            section = cls
            out.append(f"\n## {_TITLES.get(cls.__name__, cls.__name__)}\n")
            out.append(_INTROS.get(cls.__name__) or _plain(cls.__doc__))
            out.append("")
            out.append("| keyword | default | meaning |")
            out.append("|---|---|---|")
        doc, shown = keyword_doc(f)
        default = shown if shown is not None else _default(f.default)
        out.append(f"| `{key}` | {default} | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(out) + "\n"


def missing_docs() -> list[str]:
    """Keywords declared without a doc."""
    return [key for key, _, f in keyword_fields() if not keyword_doc(f)[0].strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Writes Markdown to stdout: zero-offload keywords > docs/keywords.md"


def run(args: argparse.Namespace) -> int:
    print(markdown(), end="")
    return 0
