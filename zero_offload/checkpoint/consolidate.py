"""One ordinary full-precision state dict from a sharded checkpoint, no converter needed.

Reads only the master section of each rank file, straight into the output tensors, one
parameter at a time: memory is one fp32 copy of the parameters (what the output is) and
nothing of the optimizer state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..progress import Progress
from .format import load_plain, pieces, read_manifest, verify_rank_file
from .source import _Reader
from .tags import checkpoint_root, resolve_tag, tag_folder

__all__ = ["consolidate_checkpoint"]

log = logging.getLogger(__name__)


def _save(state: dict[str, torch.Tensor], aliases: dict[str, str], out: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        full = dict(state)
        full.update({alias: state[name] for alias, name in aliases.items()})
        torch.save(full, out)  # shared storage for tied names, as torch.save keeps it
        return
    # safetensors stores no shared tensors: tied names go in the metadata instead
    save_file(state, str(out), metadata={f"alias:{a}": n for a, n in aliases.items()})


def consolidate_checkpoint(
    directory: str | os.PathLike,
    tag: str | None = None,
    out: str | os.PathLike | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (and module buffers) under their original names. With ``out``,
    also written there: safetensors when installed (tied names in its metadata), else
    ``torch.save``. ``verify``: check every rank file's size and checksums first.
    ``directory``: the folder given to ``save_checkpoint``, or a Hugging Face Trainer
    checkpoint folder holding one (``checkpoint-N``), or the Trainer's ``output_dir`` (its
    newest ``checkpoint-N``)."""
    root = checkpoint_root(Path(directory))
    folder = tag_folder(root, resolve_tag(root, tag))
    manifest = read_manifest(folder)
    if verify:
        for record in manifest.ranks:
            verify_rank_file(folder / record.file, record)
    state: dict[str, torch.Tensor] = {}
    reader = _Reader(folder, manifest)
    progress = Progress(
        f"consolidating checkpoint {folder}",
        sum(slot.numel for unit in manifest.units for slot in unit.slots),
        "parameters",
        logger=log,
    )
    try:
        for unit in manifest.units:
            for slot in unit.slots:
                tensor = torch.empty(slot.numel, dtype=torch.float32)
                for rank, element, count, at in pieces(unit, slot, 0, slot.numel):
                    reader.read(rank, 0, element, tensor[at : at + count])
                state[slot.name] = tensor.view(slot.shape)
                progress.update(slot.numel)
    finally:
        progress.close()
        reader.close()
    buffers = load_plain(folder / "rank0.extra.pt").get("buffers", {})
    state.update(buffers)
    if out is not None:
        _save(state, manifest.aliases, Path(out))
    state.update({alias: state[name] for alias, name in manifest.aliases.items()})
    return state
