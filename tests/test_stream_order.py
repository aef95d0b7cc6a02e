"""The side-stream ordering logic, checked on the CPU: ``LateStreams`` plays a GPU whose side
streams run late. Every copy or gather it is asked for happens only when its event is waited
for (until then the target holds NaNs or stale values), so an engine that uses a copy, a
gathered unit or a staged gradient before waiting for its event trains to different numbers.
The same engine code runs as on CUDA (``streams.cuda`` is True); only the stream layer is
played. Training must match the plain CPU engine bit for bit."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch
from support.models import TinyGPT, batch, loss_fn

from zero_offload.config import build_config
from zero_offload.device.streams import Streams
from zero_offload.engine.engine import Engine
from zero_offload.engine.parts import Runtime


class LateEvent:
    """Does its deferred work once, when first waited for."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work: Callable[[], None] | None = work

    def synchronize(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            work()


class LateStreams(Streams):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.cuda = True  # take the engine's CUDA branches
        self.events = 0
        self.copies_into = 0  # host-to-device copies into existing device tensors
        # initialize() copies device shards (the source is on the device: inline on CUDA)
        self.defer_copies_into = False
        self._pending: list[LateEvent] = []  # copies sync_h2d has to wait for

    def _late(self, work: Callable[[], None]) -> LateEvent:
        self.events += 1
        return LateEvent(work)

    def to_device(self, host, dtype=None, *, own=False):
        dtype = dtype or host.dtype
        out = torch.full(host.shape, float("nan"), dtype=dtype)
        return out, self._late(lambda: out.copy_(host))

    def copy_into(self, target, values):
        if target.data_ptr() == values.data_ptr() or not self.defer_copies_into:
            target.copy_(values)
            return None
        self.copies_into += 1
        target.fill_(float("nan"))  # the old values are gone, the new not there yet
        event = self._late(lambda: target.copy_(values))
        self._pending.append(event)
        return event

    def to_host(self, values, out):
        return self._late(lambda: out.copy_(values))

    def wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def handed_over(self, tensor) -> None:
        pass

    @contextlib.contextmanager
    def on_gather(self, after) -> Iterator[None]:
        self.wait(after)
        yield

    def finish_gather(self, shard, full):
        filled = full.clone()
        full.fill_(float("nan"))  # not there until the event is waited for
        return self._late(lambda: full.copy_(filled))

    def sync_h2d(self) -> None:
        # to_device copies are each waited for before their source changes; copy_into ones
        # (stage 3's params on the device) run here, when the host waits for the stream
        pending, self._pending = self._pending, []
        for event in pending:
            event.synchronize()

    def host_empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)


CASES = [
    (2, "cpu", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
    (1, "cpu", "none"),
    (3, "nvme", "none"),
]


def _train(
    tmp_path, stage, opt, param, late: bool, monkeypatch, **kwargs
) -> tuple[dict, list[Streams]]:
    made: list[Streams] = []
    runtime = Runtime()
    if late:

        def factory(device):
            made.append(LateStreams(device))
            return made[-1]

        runtime = Runtime(streams=factory)
    torch.manual_seed(0)
    engine = Engine(
        TinyGPT(),
        runtime=runtime,
        config=build_config(
            stage=stage,
            offload_optimizer=opt,
            offload_param=param,
            nvme_path=tmp_path,
            dtype=torch.bfloat16,
            lr=1e-3,
            max_grad_norm=1.0,
            prefetch_depth=2,
            gradient_accumulation_steps=2,
            **kwargs,
        ),
    )
    for streams in made:
        streams.defer_copies_into = True
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        x, y = batch("gpt", 4, gen)
        loss = loss_fn("gpt", engine(x), y)
        assert torch.isfinite(loss), "a NaN: something read a copy or gather before its event"
        engine.backward(loss)
        engine.step()
    sd = engine.full_state_dict()
    engine.close()
    monkeypatch.undo()
    return sd, made


@pytest.mark.parametrize("stage,opt,param", CASES)
def test_late_side_streams_change_no_bit(tmp_path, monkeypatch, stage, opt, param):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, _ = _train(tmp_path / "a", stage, opt, param, False, monkeypatch)
    late, made = _train(tmp_path / "b", stage, opt, param, True, monkeypatch)
    assert made[0].events > 0, "the late streams were not used"
    for name in plain:
        assert torch.equal(plain[name], late[name]), name


def test_params_on_device_take_asynchronous_copies_after_a_host_step(tmp_path, monkeypatch):
    """Stage 3 with the optimizer on the host and the params on the device: each unit's new
    shard goes to the device as an asynchronous copy (not a blocking ``copy_`` per unit), and
    the step waits for those copies before their host source is reused — NVMe sub-groups of
    3000 params reuse one output buffer and cut units, so a copy still pending when the next
    sub-group is computed would carry its values (or NaNs) and change the result."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, _ = _train(tmp_path / "a", 3, "nvme", "none", False, monkeypatch, sub_group_size=3000)
    late, made = _train(tmp_path / "b", 3, "nvme", "none", True, monkeypatch, sub_group_size=3000)
    assert made[0].copies_into > 0, "the updated shards were copied synchronously"
    for name in plain:
        assert torch.equal(plain[name], late[name]), name
