"""Optimizer state split between host memory and NVMe (``offload_optimizer_fraction``): every
split trains to the same bits as the unsplit runs, checkpoints move between splits and world
sizes exactly, the ledger and the estimate count the split, and disk traffic follows it."""

from __future__ import annotations

import os

import pytest
import torch
from support.distributed import run_ranks
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.swap.io import OsBackend
from zero_offload.update.nvme.pipeline import SubGroupPipeline
from zero_offload.update.nvme.sizing import host_groups, host_placement, optimizer_split

GROUP = 4096  # small sub-groups: TinyGPT's shard is cut into several
# (offload_optimizer, offload_optimizer_fraction); ("cpu", None) and ("nvme", None) are
# the unsplit runs everything is compared with
PLACEMENTS = [
    ("cpu", None),
    ("nvme", None),
    ("nvme", 0.0),
    ("nvme", 0.5),
    ("nvme", 1.0),
    ("nvme", "auto"),
]
TIGHT = 250_000  # host_memory_limit (bytes) × ranks that sends TinyGPT's gradients to files


def _kwargs(stage: int, opt: str, fraction, nvme: str, **extra) -> dict:
    kw = dict(
        stage=stage,
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.05,
        dtype=torch.bfloat16,
        offload_optimizer=opt,
        sub_group_size=GROUP,
    )
    kw.update(extra)
    if opt == "nvme":
        kw.update(nvme_path=nvme, offload_optimizer_fraction=fraction)
    if stage == 3:
        kw.update(offload_param="nvme", nvme_path=nvme)
    return kw


def _steps(engine, rank: int, world: int, start: int, end: int) -> None:
    for i in range(start, end):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        per = 8 // world
        sl = slice(rank * per, (rank + 1) * per)
        engine.backward(loss_fn("gpt", engine(x[sl]), y[sl]))
        engine.step()


def _state(engine) -> dict[str, torch.Tensor]:
    """Full parameters, this rank's flat [master | m | v] and the step count."""
    chunks = [
        [a.clone() for a in arrays]  # a chunk in files is used before the next read
        for _lo, arrays in engine.state_chunks()
        if arrays[1] is not None
    ]
    parts = [torch.cat([c[k] for c in chunks]) for k in range(3)]
    out = {f"param.{k}": v for k, v in engine.full_state_dict().items()}
    out.update(
        {
            "master": parts[0],
            "exp_avg": parts[1],
            "exp_avg_sq": parts[2],
            "steps": torch.tensor(engine.optimizer_steps),
        }
    )
    return out


def _params(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.startswith("param.") or k == "steps"}


def _host_groups(engine) -> int | None:
    """Sub-groups of the NVMe optimizer kept in host memory (None: not on NVMe)."""
    split = engine.optimizer_split
    return None if split is None else -(-split.host_numel // split.sizing.group)


def _assert_same(a: dict, b: dict, what) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), (what, name)


def _train_placements(rank: int, world: int, nvme: str) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for extra in ({}, {"host_memory_limit": TIGHT // world}):
            if extra and stage != 2:
                continue
            for opt, fraction in PLACEMENTS:
                torch.manual_seed(0)
                engine = zo.initialize(TinyGPT(), **_kwargs(stage, opt, fraction, nvme, **extra))
                _steps(engine, rank, world, 0, 3)
                out[(stage, bool(extra), opt, fraction)] = (
                    _state(engine),
                    _host_groups(engine),
                    engine.grads is None,
                )
                engine.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_every_split_trains_to_the_bits_of_the_unsplit_runs(world, tmp_path):
    """Fractions 0, ½, 1 and "auto" at stages 1-3 equal offload_optimizer="cpu" and the
    all-NVMe run bit for bit, also with the gradients in files (a tight host budget)."""
    for rank, results in enumerate(run_ranks(world, _train_placements, str(tmp_path))):
        for (stage, tight, opt, fraction), (state, groups, grads_in_files) in results.items():
            # the parameters as offload_optimizer="cpu" trains them; the rank-flat state
            # (whose padding elements the host tier leaves uninitialized) as all-NVMe does
            host = results[(stage, tight, "cpu", None)][0]
            _assert_same(_params(state), _params(host), (rank, stage, tight, opt, fraction))
            if opt == "nvme":
                _assert_same(
                    state,
                    results[(stage, tight, "nvme", None)][0],
                    (rank, stage, tight, opt, fraction),
                )
            if opt == "nvme":
                total = results[(stage, tight, "nvme", 0.0)][1]
                assert (
                    groups == {None: 0, 1.0: 0, 0.0: total, 0.5: groups, "auto": groups}[fraction]
                )
                if fraction == 0.5:  # the whole sub-groups nearest to half
                    assert groups in (total // 2, (total + 1) // 2)
                assert total >= 3 and grads_in_files == tight
        half = results[(2, True, "nvme", 0.5)][1]
        assert 0 < half < results[(2, True, "nvme", 0.0)][1]  # a real split, grads in files
        # the budget decides: all in host memory when it is roomy, a part when it is tight
        assert results[(2, False, "nvme", "auto")][1] == results[(2, False, "nvme", 0.0)][1]
        assert results[(2, True, "nvme", "auto")][1] < results[(2, True, "nvme", 0.0)][1]


SAVED_AS = ("nvme", 0.5)  # the placement the split-to-split checkpoints are saved from


def _resume_across(rank: int, world: int, root: str, phase: str) -> dict:
    """For stages 2 and 3 in one set of processes: 'before': 4 steps straight at ½ on NVMe,
    then 2 steps at ½ and save; 'resume' (new processes): load into every placement and take
    the last 2 steps; 'load' (one rank): just load. Keyed (stage, run, placement)."""
    out = {}
    for stage in (2, 3):
        ckpt, nvme = _across_paths(root, stage)
        runs = ("straight", "save") if phase == "before" else (phase,)
        for run in runs:
            for opt, fraction in [SAVED_AS] if phase == "before" else PLACEMENTS:
                torch.manual_seed(0 if phase == "before" else 3)
                engine = zo.initialize(TinyGPT(), **_kwargs(stage, opt, fraction, nvme))
                if run == "straight":
                    _steps(engine, rank, world, 0, 4)
                elif run == "save":
                    _steps(engine, rank, world, 0, 2)
                    engine.save_checkpoint(ckpt, tag="half")
                else:
                    engine.load_checkpoint(ckpt)
                    if run == "resume":
                        _steps(engine, rank, world, 2, 4)
                out[(stage, run, (opt, fraction))] = (
                    _state(engine)
                    if run != "load"
                    else (
                        {k: v for k, v in _state(engine).items() if k.startswith("param.")},
                        engine.optimizer_steps,
                    )
                )
                engine.close()
    return out


def _across_paths(root: str, stage: int) -> tuple[str, str]:
    """The checkpoint folder and the NVMe folder of one stage's runs."""
    return os.path.join(root, f"ckpt{stage}"), os.path.join(root, f"nvme{stage}")


@pytest.fixture(scope="module")
def across(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict], dict]:
    """Both stages' runs in three spawns: before (two ranks), resume (two), load (one)."""
    root = str(tmp_path_factory.mktemp("across"))
    for stage in (2, 3):
        os.makedirs(_across_paths(root, stage)[1])
    before = run_ranks(2, _resume_across, root, "before")
    resumed = run_ranks(2, _resume_across, root, "resume")
    loaded = run_ranks(1, _resume_across, root, "load")[0]
    return before, resumed, loaded


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_moves_between_splits_and_world_sizes_exactly(stage, across):
    """Saved with half the optimizer state on NVMe by two ranks: loaded into host memory
    (cpu), all-NVMe, fraction 0, 1 or auto, the run goes on to the bits of the straight run;
    one rank loads it into every placement with the same parameters and step count."""
    before, resumed, loaded = across
    for rank in range(2):
        for placement in PLACEMENTS:
            state = resumed[rank][(stage, "resume", placement)]
            _assert_same(state, before[rank][(stage, "straight", SAVED_AS)], (rank, placement))
    saved = before[0][(stage, "save", SAVED_AS)]
    want = {k: v for k, v in saved.items() if k.startswith("param.")}
    for placement in PLACEMENTS:
        params, steps = loaded[(stage, "load", placement)]
        assert steps == 2, placement
        _assert_same(params, want, placement)


class CountingBackend(OsBackend):
    """The real syscalls, with the bytes they moved counted."""

    def __init__(self) -> None:
        self.read = self.written = 0

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        self.read += n
        return n

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        n = super().pwritev(fd, buffers, offset)
        self.written += n
        return n


def _disk_bytes_of_a_step(tmp_path, fraction) -> tuple[int, int, object]:
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(), **_kwargs(2, "nvme", fraction, str(tmp_path)))
    _steps(engine, 0, 1, 0, 1)
    counter = CountingBackend()
    engine.swappers[0].engine.backend = counter
    _steps(engine, 0, 1, 1, 2)
    timings = engine.last_step_timings
    split = engine.optimizer_split
    # each sub-group's file is padded to whole 4 KiB pages for direct I/O
    group = split.sizing.group
    padded = sum(
        -(-12 * min(group, split.numel - lo) // 4096) * 4096
        for lo in range(split.host_numel, split.numel, group)
    )
    assert counter.read == counter.written == padded
    assert timings.bytes_read == timings.bytes_written == 12 * split.nvme_numel
    engine.close()
    return timings.bytes_read, timings.bytes_written, split


def test_disk_bytes_per_step_fall_in_proportion(tmp_path):
    """Counted at the syscalls: the optimizer reads and writes the sub-groups in files (12
    bytes per element, padded to pages) and nothing for those in host memory."""
    full_read, full_written, full = _disk_bytes_of_a_step(tmp_path, 1.0)
    assert full_read == full_written == 12 * full.numel > 0
    for fraction in (0.5, 0.0):
        read, written, split = _disk_bytes_of_a_step(tmp_path, fraction)
        assert abs(read / full_read - fraction) <= GROUP / full.numel  # whole sub-groups
        assert split.disk_bytes_per_step() == read + written


def test_ledger_and_estimate_count_the_split(tmp_path):
    """The ledger puts 12 bytes per element of each sub-group where it lives; estimate_memory
    places the same sub-groups (one sizing rule) for a fraction and for "auto"."""
    for fraction, limit in ((0.5, None), ("auto", 2_000_000), ("auto", 400_000)):
        torch.manual_seed(0)
        model = TinyGPT()
        engine = zo.initialize(
            model,
            **_kwargs(
                2, "nvme", fraction, str(tmp_path), dtype=torch.float32, host_memory_limit=limit
            ),
        )
        _steps(engine, 0, 1, 0, 1)
        report = engine.memory_report()
        split = engine.optimizer_split
        with torch.device("meta"):
            shape = TinyGPT()
        e = zo.estimate_memory(
            shape,
            num_gpus=1,
            stage=2,
            offload_optimizer="nvme",
            dtype=torch.float32,
            device="cpu",
            sub_group_size=GROUP,
            host_memory_limit=limit,
            host_available=8 << 30,
            offload_optimizer_fraction=fraction,
        )
        assert 0 < split.host_numel < split.numel or limit == 2_000_000
        assert (
            report.bytes["nvme"]["optimizer"] == 12 * split.nvme_numel == e.resident_bytes("nvme")
        )
        host_part = sum(t.bytes for t in e.terms if t.name == "optimizer state (host part)")
        assert host_part == split.host_state_bytes
        assert e.nvme_fraction == split.nvme_fraction
        assert e.disk_bytes_per_step == split.disk_bytes_per_step()
        assert abs(report.total("host") - e.resident_bytes("host")) <= 0.1 * e.resident_bytes(
            "host"
        )
        engine.close()


def test_auto_fills_what_the_budget_leaves_beside_the_pipeline():
    numel, budget = 10 * (1 << 20), 200 << 20
    split = optimizer_split(numel, 1 << 20, budget, 2, "auto")
    pipeline = split.sizing.host_bytes(numel, 2)
    assert split.host_numel % split.sizing.group == 0
    assert pipeline + split.host_state_bytes <= budget
    assert pipeline + split.host_state_bytes + 12 * split.sizing.group > budget
    assert optimizer_split(numel, 1 << 20, 1 << 40, 2, "auto").host_numel == numel
    assert optimizer_split(numel, 1 << 20, budget, 2, None).host_numel == 0
    assert host_groups(10, 4, 0.0, 0) == 3 and host_groups(0, 4, 0.0, 0) == 0
    # a short last sub-group: 0 still keeps all of it in host memory, 1 none, ½ the nearest
    assert [host_groups(3300, 1000, f, 0) for f in (0.0, 0.5, 1.0)] == [4, 2, 0]


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
def test_sub_groups_in_files_are_spread_between_those_in_host_memory(tmp_path, moments):
    """The update steps the sub-groups in order (under the next forward, as it reaches their
    units) and reads one sub-group in files ahead. With the host ones leading, the disk
    idled under that whole stretch and the forward then waited on every read (99M, half
    the state in files: the forward took its compute plus the disk time). Spread, each read
    runs under the host sub-groups before it; the first sub-group is in host memory (it
    hides the first read), the last (a short remainder) in files, so the host bytes are
    those of whole sub-groups, what the estimate counts. Seen from the swap files."""
    assert host_placement(8, 4) == (True, False) * 4
    assert host_placement(6, 2) == (True, False, False, True, False, False)
    assert host_placement(5, 0) == (False,) * 5 and host_placement(5, 5) == (True,) * 5
    engine = zo.initialize(
        TinyGPT(),
        **_kwargs(2, "nvme", 0.5, str(tmp_path)),
        moment_precision=moments,
    )
    try:
        in_files = sorted(
            int(f.name.split(".")[-2])
            for f in tmp_path.rglob("*.swp")
            if "-adam." in f.name or "-state." in f.name
        )
        groups = in_files[-1] + 1  # the last sub-group is in files
        assert groups >= 4 and abs(len(in_files) - groups / 2) <= 0.5
        placement = host_placement(groups, groups - len(in_files))
        assert in_files == [i for i, host in enumerate(placement) if not host]
        assert in_files[0] > 0
    finally:
        engine.close()


def test_the_pipeline_reads_the_next_file_under_the_host_sub_groups():
    """Stepping host sub-group k, the read of the next sub-group in files is in flight
    already; each file's buffers go back after the next file's step (three buffers)."""
    events: list[tuple[str, int]] = []

    class Groups:
        def read_group(self, i, timings):
            events.append(("read", i))
            return ()

        def step_group(self, i, got, timings):
            events.append(("step", i))

        def release_group(self, i):
            events.append(("release", i))

        def drop_group(self, i, changed):
            raise AssertionError("nothing fails")

    on_host = (True, False, True, False, True, False)
    pipeline = SubGroupPipeline([(i, i + 1) for i in range(6)], on_host)
    assert list(pipeline.run(Groups(), lookahead=True)) == [1, 2, 3, 4, 5, 6]
    files = [e for e in events if not on_host[e[1]]]
    assert files == [
        ("read", 1),
        ("read", 3),
        ("step", 1),
        ("read", 5),
        ("step", 3),
        ("release", 1),
        ("step", 5),
        ("release", 3),
        ("release", 5),
    ]
    for k in (0, 2, 4):  # the next file's read started before the host sub-group's step
        assert events.index(("read", k + 1)) < events.index(("step", k))


@pytest.mark.parametrize(
    "value, match",
    [(1.5, "<= 1"), (-0.1, ">= 0"), ("half", "or 'auto'"), (True, "expected a number")],
)
def test_a_bad_fraction_names_the_key(value, match, tmp_path):
    with pytest.raises(zo.ConfigError, match=match) as err:
        zo.initialize(
            TinyGPT(),
            stage=2,
            offload_optimizer="nvme",
            nvme_path=tmp_path,
            offload_optimizer_fraction=value,
        )
    assert "offload_optimizer_fraction" in str(err.value)


def test_a_fraction_without_the_optimizer_on_nvme_names_the_fix():
    with pytest.raises(zo.ConfigError, match="needs offload_optimizer='nvme'"):
        zo.initialize(TinyGPT(), stage=2, offload_optimizer="cpu", offload_optimizer_fraction=0.5)


def test_plan_gives_spare_host_memory_to_the_optimizer():
    """13B on 4 × 24 GB GPUs with 128 GB of host memory: the plan keeps a third or more of
    the optimizer state in host memory, within the usable host memory, and its keyword
    arguments make the estimate (the engine's rule) place the same split."""
    p = zo.plan(13e9, num_gpus=4, gpu_memory=24 * 10**9, host_memory=128 * 10**9)
    c, e = p.choice, p.choice.estimate
    assert (c.stage, c.offload_optimizer) == (3, "nvme")
    assert p.kwargs["offload_optimizer_fraction"] == "auto"
    assert e.nvme_fraction <= 0.67 and e.host_bytes_per_node <= 128e9 * (1 - p.headroom)
    assert e.disk_bytes_per_step < 0.67 * c.all_nvme_disk_bytes
    assert c.all_nvme_disk_bytes == 24 * 13e9 / 4  # [master | m | v] read and written
    again = zo.estimate_memory(
        13e9,
        num_gpus=4,
        stage=3,
        offload_optimizer="nvme",
        offload_param=p.kwargs["offload_param"],
        host_memory_limit=p.kwargs["host_memory_limit"],
        offload_optimizer_fraction="auto",
        host_available=128 * 10**9,
    )
    assert again.nvme_fraction == e.nvme_fraction and again.terms == e.terms
    assert "less than all on NVMe" in p.explanation


# -- stage 3 parameter shards split between host memory and NVMe ------------------------------
def _train_param_split(rank: int, world: int, nvme: str, ckpt: str) -> dict:
    out = {}
    for opt in ("nvme", "cpu"):
        for fraction in (None, 0.0, 0.5, 1.0):
            torch.manual_seed(0)
            engine = zo.initialize(
                TinyGPT(), **_kwargs(3, opt, None, nvme, offload_param_fraction=fraction)
            )
            _steps(engine, rank, world, 0, 2)
            if (opt, fraction) == ("nvme", 0.5):
                engine.save_checkpoint(ckpt, tag="params-half")
            _steps(engine, rank, world, 2, 3)
            store = engine.param_store
            out[(opt, fraction)] = (
                _params(_state(engine)),
                store.host_numel,
                engine.memory_report().bytes["nvme"]["params"],
            )
            engine.close()
    for fraction in (0.0, 1.0):  # resumed into another split: the same last step
        torch.manual_seed(3)
        engine = zo.initialize(
            TinyGPT(), **_kwargs(3, "nvme", None, nvme, offload_param_fraction=fraction)
        )
        engine.load_checkpoint(ckpt)
        _steps(engine, rank, world, 2, 3)
        out[("resumed", fraction)] = (_params(_state(engine)), engine.param_store.host_numel, 0)
        engine.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_param_shards_split_by_unit_train_and_resume_to_the_same_bits(world, tmp_path):
    """offload_param_fraction 0, ½, 1 (optimizer on NVMe or on the host) trains to the bits of
    all params in files; a checkpoint saved at ½ resumes at 0 and 1 to the same bits; the
    ledger counts only the units in files on NVMe."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_ranks(world, _train_param_split, str(nvme), str(tmp_path / "ckpt"))
    for rank, res in enumerate(results):
        want, _, all_bytes = res[("nvme", None)]
        total = res[("nvme", 0.0)][1]
        for (opt, fraction), (params, host_numel, nvme_bytes) in res.items():
            _assert_same(params, want, (rank, opt, fraction))
            if opt == "resumed":
                continue
            expect = {None: 0, 1.0: 0, 0.0: total, 0.5: host_numel}[fraction]
            assert host_numel == expect
            assert nvme_bytes == all_bytes - 2 * host_numel  # bf16 shards
        assert 0 < res[("nvme", 0.5)][1] < total


def test_estimate_places_the_same_param_units_as_the_engine(tmp_path):
    torch.manual_seed(0)
    engine = zo.initialize(
        TinyGPT(), **_kwargs(3, "nvme", None, str(tmp_path), offload_param_fraction=0.5)
    )
    with torch.device("meta"):
        shape = TinyGPT()
    e = zo.estimate_memory(
        shape,
        num_gpus=1,
        stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        dtype=torch.bfloat16,
        device="cpu",
        sub_group_size=GROUP,
        offload_param_fraction=0.5,
    )
    terms = {t.name: t.bytes for t in e.terms}
    host_numel = engine.param_store.host_numel
    assert 0 < host_numel < engine.shard_numel
    assert terms["param shards (host part)"] == 2 * host_numel
    assert terms["param shards"] == engine.memory_report().bytes["nvme"]["params"]
    engine.close()


def test_a_param_fraction_needs_params_on_nvme(tmp_path):
    with pytest.raises(zo.ConfigError, match="needs offload_param='nvme'"):
        zo.initialize(TinyGPT(), stage=3, offload_param="cpu", offload_param_fraction=0.5)
    with pytest.raises(zo.ConfigError, match="offload_param_fraction"):
        zo.initialize(
            TinyGPT(), stage=3, offload_param="nvme", nvme_path=tmp_path, offload_param_fraction=2
        )
