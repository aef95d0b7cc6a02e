"""Checkpoint tags: which names are allowed, which folder a tag's checkpoint is in, and how
a new checkpoint takes over a tag so that one complete checkpoint is loadable at every instant.

A save writes ``DIR/.<tag>.partial`` completely (manifest last) before it touches the tag.
Taking over an existing tag is two renames — ``<tag>`` → ``.<tag>.replaced``, then
``.<tag>.partial`` → ``<tag>`` — and in the moment between them ``<tag>`` is missing. So a
tag resolves to the first complete folder of ``<tag>``, ``.<tag>.partial``, ``.<tag>.replaced``
(complete: its manifest exists, which is written last), and the next save of that tag first
puts the survivor back in place. ``latest`` is one file replaced atomically.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from .format import MANIFEST, CheckpointError, fsync_dir

__all__ = [
    "LATEST",
    "TRAINER_SUBDIR",
    "check_tag",
    "checkpoint_root",
    "resolve_tag",
    "tag_folder",
    "recover_tag",
    "commit_tag",
]

log = logging.getLogger(__name__)

LATEST = "latest"
TRAINER_SUBDIR = "zero_offload"  # the engine checkpoint inside a Hugging Face Trainer checkpoint
_TRAINER_CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # Trainer's folder names under output_dir
_INTERNAL = (".tmp", ".partial", ".replaced")  # suffixes of names the save itself uses
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


def check_tag(tag: object) -> str:
    """``tag`` if it can name a checkpoint folder, else a ValueError saying what is allowed."""
    if (
        not isinstance(tag, str)
        or not _TAG.fullmatch(tag)
        or tag == LATEST
        or tag.endswith(_INTERNAL)
    ):
        raise ValueError(
            f"tag={tag!r} cannot name a checkpoint: use 1-200 letters, digits and . _ + - "
            f"starting with a letter or digit (e.g. 'step100', 'best'), not {LATEST!r} and "
            f"not ending in {', '.join(_INTERNAL)} (names the save uses itself)"
        )
    return tag


def checkpoint_root(directory: Path) -> Path:
    """The folder given to ``save_checkpoint`` that ``directory`` names: itself, the engine
    checkpoint inside a Trainer checkpoint folder (``checkpoint-N/zero_offload``), or that of
    the newest ``checkpoint-N`` in a Trainer's ``output_dir``. Readers that take a tag use it
    so that any of the three paths a user has at hand works."""
    if (directory / LATEST).is_file() or not directory.is_dir():
        return directory
    if (directory / TRAINER_SUBDIR / LATEST).is_file():
        return directory / TRAINER_SUBDIR
    steps = [
        (int(m.group(1)), child)
        for child in directory.iterdir()
        if (m := _TRAINER_CHECKPOINT.fullmatch(child.name))
        and (child / TRAINER_SUBDIR / LATEST).is_file()
    ]
    if not steps:
        return directory
    newest = max(steps)[1] / TRAINER_SUBDIR
    log.warning("%s: using the newest Trainer checkpoint, %s", directory, newest)
    return newest


def _loadable_name(tag: str, where: Path) -> str:
    """Tags read back are only kept inside the folder (older versions allowed more names)."""
    if (
        not tag
        or tag.startswith(".")
        or "\0" in tag
        or os.sep in tag
        or (os.altsep and os.altsep in tag)
        or tag == LATEST
    ):
        raise CheckpointError(f"{where}: {tag!r} is not a checkpoint tag")
    return tag


def resolve_tag(directory: Path, tag: str | None) -> str:
    """``tag``, or the one ``DIR/latest`` names."""
    if tag is not None:
        name = _loadable_name(tag, directory)
        if directory.is_dir() and not any(f.exists() for f in _candidates(directory, name)):
            tags = sorted(p.name for p in directory.iterdir() if p.is_dir() and p.name[0] != ".")
            raise CheckpointError(
                f"{directory}: no tag {name!r}; its tags are {', '.join(tags) or '(none)'}: "
                "pass one of them as tag= (--tag), or none for the latest"
            )
        return name
    latest = directory / LATEST
    try:
        text = latest.read_text()
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{latest}: no such file, so no complete checkpoint is in {directory} (nor in a "
            f"Trainer checkpoint folder's {TRAINER_SUBDIR}/, nor in an output_dir's "
            "checkpoint-N/); pass the folder given to save_checkpoint, or tag= to pick one"
        ) from exc
    # older versions wrote tags with surrounding spaces as they were
    name = text if text.strip() != text and tag_folder(directory, text).exists() else text.strip()
    return _loadable_name(name, latest)


def _complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def _candidates(directory: Path, tag: str) -> tuple[Path, Path, Path]:
    return directory / tag, directory / f".{tag}.partial", directory / f".{tag}.replaced"


def tag_folder(directory: Path, tag: str) -> Path:
    """The folder holding ``tag``'s complete checkpoint: ``DIR/<tag>`` unless a save that
    was taking the tag over stopped between its renames (then the complete one beside it).
    With none complete, ``DIR/<tag>`` (whose missing manifest the reader reports)."""
    for folder in _candidates(directory, tag):
        if _complete(folder):
            if folder.name != tag:
                log.warning(
                    "checkpoint %r: using %s, left by a save that stopped while replacing it",
                    tag,
                    folder,
                )
            return folder
    return directory / tag


def recover_tag(directory: Path, tag: str) -> None:
    """Before a new save of ``tag``: put back a complete checkpoint that a stopped save left
    beside the tag (one rename), then drop what is left of stopped saves."""
    final, partial, replaced = _candidates(directory, tag)
    if not _complete(final):
        for survivor in (partial, replaced):
            if _complete(survivor):
                shutil.rmtree(final, ignore_errors=True)
                os.replace(survivor, final)
                fsync_dir(directory)
                log.warning("checkpoint %r: restored %s, left by a stopped save", tag, survivor)
                break
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(replaced, ignore_errors=True)


def commit_tag(directory: Path, tag: str) -> Path:
    """Make the complete ``.<tag>.partial`` the tag's checkpoint; returns ``DIR/<tag>``."""
    final, partial, replaced = _candidates(directory, tag)
    if final.exists():
        os.replace(final, replaced)  # until the next rename, tag_folder finds ``partial``
    os.replace(partial, final)
    fsync_dir(directory)
    shutil.rmtree(replaced, ignore_errors=True)
    return final
