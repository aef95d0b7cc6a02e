"""Before a run: the memory estimate of a configuration and the planner that searches for one
that fits."""
