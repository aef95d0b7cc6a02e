"""What one rank holds per tier for a configuration, computed from the sizing rules of the
parts that allocate it: the estimate, its terms, the model's shape, the optimizer state and
the activations."""
