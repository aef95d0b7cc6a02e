"""Benchmarks: the parts on their own (``micro/``), training steps and runs (``training/``),
the interrupt campaign (``interrupts/``) and the GPT model they share (``gpt``)."""
