"""Parameters: flat units (a module's parameters as views into one buffer), where each rank's
shard lives between uses, and stage 3's gather before a module runs and release after it."""
