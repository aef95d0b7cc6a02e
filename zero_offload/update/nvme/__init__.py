"""``offload_optimizer="nvme"``: the optimizer state in files, stepped sub-group by sub-group
through one read / compute / write pipeline (``pipeline``) by ``adam`` (fp32 AdamW) and
``state`` (every other state policy), sized to the host budget (``sizing``), and stepped
early during backward (``early``)."""
