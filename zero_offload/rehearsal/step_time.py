"""A rehearsal's predicted step: the step-time model (``planning.step_time.predict``) fed with what
the rehearsed step itself computed and moved: the FLOPs of its forward and backward (torch's
``FlopCounterMode``), its host-device copies and its disk reads and writes per phase.

The rehearsal runs the whole update inside ``step()`` (``finish_step``), so the step's disk
bytes are the update's; the model then places the update where the configuration runs it
(under the backward, under the next forward) as it does for the planner's figures.
"""

from __future__ import annotations

from dataclasses import replace

from ..planning.step_time.advice import predict_step
from ..planning.step_time.hardware import Rates
from ..planning.step_time.predict import PhaseWork, StepPrediction, workload
from .report import Rehearsal

__all__ = ["predicted_step"]


def predicted_step(result: Rehearsal, rates: Rates) -> StepPrediction:
    """The step of ``result``'s configuration at ``rates``, from its measured counts."""
    if result.micro_batch is None:
        raise ValueError("the predicted step needs the tokens of a step: rehearse a micro_batch")
    kw = result.engine_kwargs
    b, s = result.micro_batch
    base = workload(
        result.estimate,
        tokens=b * s,
        checkpointing=result.checkpointing,
        overlap_step=bool(kw.get("overlap_step", True)),
        step_during_backward=bool(kw.get("step_during_backward", True)),
    )
    phases = result.phases

    def measured(name: str, planned: PhaseWork) -> PhaseWork:
        m = phases.get(name)
        if m is None:
            return planned
        return replace(
            planned,
            flops=float(m.flops) or planned.flops,
            h2d=float(m.h2d_bytes),
            d2h=float(m.d2h_bytes),
            disk_read=float(m.nvme_read),
            disk_write=float(m.nvme_written),
        )

    step = phases.get("step")
    update = base.update
    if step is not None and (step.nvme_read or step.nvme_written):
        update = replace(
            update, disk_read=float(step.nvme_read), disk_write=float(step.nvme_written)
        )
    work = replace(
        base,
        forward=measured("forward", base.forward),
        backward=measured("backward", base.backward),
        step=replace(
            base.step,
            h2d=float(step.h2d_bytes) if step else base.step.h2d,
            d2h=float(step.d2h_bytes) if step else base.step.d2h,
        ),
        update=update,
    )
    return predict_step(work, rates)
