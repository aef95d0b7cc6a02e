"""Benchmarks that train: one step through the engine and its tables, activation offload
and the tiled loss, where a rank's resident memory goes, and what optimizer-state precision
does to a training run (with the charts its report draws)."""
