"""Activation memory: saved tensors offloaded to host memory, and the tiled LM loss."""
