"""The planner: which stage × offload choice, state precision and activation measures fit a
model on given GPUs, host memory and NVMe, and the sentences that say why."""
