"""Gradients: reduction across ranks (all-reduce, reduce-scatter, unit by unit in backward),
and the reduced shard's way to an offloaded optimizer (host memory or files)."""
