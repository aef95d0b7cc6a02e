"""What memory is held: the ledger counted from real tensors, and the sizing rules that the
allocating parts and the estimate share."""
