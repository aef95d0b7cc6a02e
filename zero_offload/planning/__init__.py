"""Before a run: the memory estimate of a configuration (``estimate/``), the planner that
searches for one that fits (``search/``) and the predicted step time (``step_time/``)."""
