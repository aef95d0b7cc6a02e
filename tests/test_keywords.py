"""The keyword reference is the config's own field docs: every keyword ``initialize`` accepts
has a doc where it is declared, and ``docs/keywords.md`` is exactly what ``zero-offload
keywords`` writes from them (regenerate: ``zero-offload keywords > docs/keywords.md``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import zero_offload as zo
from zero_offload.cli import main
from zero_offload.cli.keywords import markdown, missing_docs
from zero_offload.config import keyword_fields
from zero_offload.fields import keyword, keyword_doc

PAGE = Path(__file__).resolve().parents[1] / "docs" / "keywords.md"


def test_every_keyword_has_a_doc():
    assert missing_docs() == [], (
        f"declare these keywords with zero_offload.fields.keyword(default, doc): {missing_docs()}"
    )
    assert sorted(key for key, _, _ in keyword_fields()) == zo.config_keys()


def test_the_page_is_what_the_generator_writes():
    assert PAGE.read_text() == markdown(), (
        "docs/keywords.md is out of date: run `zero-offload keywords > docs/keywords.md`"
    )
    for key in zo.config_keys():
        assert f"| `{key}` |" in PAGE.read_text()


def test_the_command_prints_the_page(capsys):
    assert main(["keywords"]) == 0
    assert capsys.readouterr().out == markdown()


def test_a_field_without_a_doc_is_found():
    @dataclass(frozen=True)
    class Section:
        documented: int = keyword(1, "one", shown="a number")
        bare: int = 2

    documented, bare = fields(Section)
    assert keyword_doc(documented) == ("one", "a number")
    assert keyword_doc(bare) == ("", None)
    assert Section().documented == 1  # the default is the field's
