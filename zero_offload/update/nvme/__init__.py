"""``offload_optimizer="nvme"``: the optimizer state in files, stepped sub-group by sub-group
as a read / compute / write pipeline (``adam``, ``state``), sized to the host budget
(``sizing``), and stepped early during backward (``early``)."""
