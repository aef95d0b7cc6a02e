"""How long a step will take: the work a step does divided by the machine's rates, per
phase, and what would move it."""
