"""``zero-offload bench interrupts``: the campaign that signals and fills the disk of a
stage-3 NVMe run at random moments (``campaign``), and the one run each trial starts
(``child``); ``python -m zero_offload.bench.interrupts`` runs the campaign."""

from .campaign import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
