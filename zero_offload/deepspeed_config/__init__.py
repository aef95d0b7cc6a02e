"""DeepSpeed JSON configs read as DeepSpeed reads them: every key decided once in one table
(:mod:`.table`: translated, accepted with the reason, or refused), translated into
:func:`zero_offload.initialize` keywords (:func:`translate`), and DeepSpeed's lr schedules as
torch schedulers (:mod:`.schedules`). ``docs/deepspeed.md`` is written from the table."""

from .schedules import SCHEDULES, check_schedule, lr_scheduler, schedule
from .translate import AUTO, is_deepspeed, keyword_autos, translate, world_size

__all__ = [
    "AUTO",
    "SCHEDULES",
    "check_schedule",
    "is_deepspeed",
    "keyword_autos",
    "lr_scheduler",
    "schedule",
    "translate",
    "world_size",
]
