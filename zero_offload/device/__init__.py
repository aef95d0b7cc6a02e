"""The compute device: which one a rank uses, copying model values onto it, and its side
streams (the same calls run inline on a CPU device)."""
