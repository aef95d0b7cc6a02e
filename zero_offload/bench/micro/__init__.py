"""Benchmarks of one part on its own: the CPU optimizer kernels and their state variants,
the swap file engine against raw direct I/O, and the short probes of a machine's rates
that a step-time prediction divides by."""
