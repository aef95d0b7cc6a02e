"""torch.distributed.checkpoint (DCP) folders between FSDP2 and zero_offload, on CPU with gloo:
- an FSDP2 run (``fully_shard`` per block and the root, torch AdamW, clipping) saved with
  ``dcp.save({"model": msd, "optim": osd})`` continues in zero_offload at world 1 and 2 and
  ends where the uninterrupted FSDP2 run ended;
- a zero_offload checkpoint exported with ``export_dcp`` (``zero-offload export-dcp``) loads
  into FSDP2 through ``get_state_dict`` / ``dcp.load`` / ``set_state_dict`` and ends there too;
- DCP's pickled values are read as plain data only: a folder holding code is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.distributed import run_ranks
from support.equivalence import training_state
from support.models import TinyGPT, batch, loss_fn

import zero_offload as zo
from zero_offload.checkpoint import CheckpointError

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

LR, WD, CLIP, WIDTH, SAVE_AT, STEPS = 1e-2, 0.1, 0.5, 16, 3, 6


def _steps(rank, world, forward, backward, start, end):
    per = 8 // world
    for i in range(start, end):
        x, y = batch("gpt", 8, torch.Generator().manual_seed(100 + i))
        backward(loss_fn("gpt", forward(x[rank * per : (rank + 1) * per]), y[rank * per :][:per]))


def _fsdp(rank, world, ckpt, phase):
    """phase 'straight': STEPS steps; 'save': SAVE_AT steps, then DCP; 'resume': DCP, the rest.
    Returns the full fp32 parameters at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    torch.manual_seed(0)
    model = TinyGPT(width=WIDTH)
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    start, end = (SAVE_AT if phase == "resume" else 0), (SAVE_AT if phase == "save" else STEPS)
    if phase == "resume":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def backward(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    _steps(rank, world, model, backward, start, end)
    if phase == "save":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _zero_offload(rank, world, ckpt, phase):
    torch.manual_seed(0 if phase == "save" else 5)  # a resume takes nothing from the init
    engine = zo.initialize(
        TinyGPT(width=WIDTH), stage=3, lr=LR, weight_decay=WD, max_grad_norm=CLIP
    )
    if phase == "resume":
        assert engine.load_checkpoint(ckpt) == Path(ckpt).name
        assert engine.optimizer_steps == SAVE_AT
    start, end = (SAVE_AT if phase == "resume" else 0), (SAVE_AT if phase == "save" else STEPS)

    def backward(loss):
        engine.backward(loss)
        engine.step()

    _steps(rank, world, engine, backward, start, end)
    if phase == "save":
        engine.save_checkpoint(ckpt)
    out = engine.full_state_dict()
    engine.close()
    return out


def _diff(got, ref):
    d = torch.cat([(got[k] - ref[k]).abs().flatten() for k in ref])
    return d.max().item() / LR, d.mean().item()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_ranks(2, _fsdp, str(tmp_path_factory.mktemp("none")), "straight")[0]


@pytest.mark.multiprocess
def test_an_fsdp2_checkpoint_continues_in_zero_offload(uninterrupted, tmp_path):
    ckpt = str(tmp_path / "fsdp")
    run_ranks(2, _fsdp, ckpt, "save")
    for world in (1, 2):
        got = run_ranks(world, _zero_offload, ckpt, "resume")[0]
        worst, mean = _diff(got, uninterrupted)
        assert worst <= 0.03 and mean <= 1e-6, (world, worst, mean)


@pytest.mark.multiprocess
def test_a_zero_offload_checkpoint_exported_to_dcp_continues_in_fsdp2(uninterrupted, tmp_path):
    from zero_offload.cli import main

    run_ranks(2, _zero_offload, str(tmp_path / "zo"), "save")
    assert main(["export-dcp", str(tmp_path / "zo"), str(tmp_path / "dcp")]) == 0
    got = run_ranks(2, _fsdp, str(tmp_path / "dcp"), "resume")[0]
    worst, mean = _diff(got, uninterrupted)
    assert worst <= 0.03 and mean <= 1e-6, (worst, mean)
    # and back: the exported folder resumes in zero_offload as well, with the same counters
    back = run_ranks(1, _zero_offload, str(tmp_path / "dcp"), "resume")[0]
    worst, mean = _diff(back, uninterrupted)
    assert worst <= 0.03 and mean <= 1e-6, (worst, mean)


def test_a_dcp_folder_holding_code_is_refused_and_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    engine = zo.initialize(TinyGPT(width=WIDTH), stage=1, lr=LR)
    state = {
        "model": engine.full_state_dict(),
        "optim": {
            "state": {
                n: {"step": torch.tensor(1.0), "exp_avg": v * 0, "exp_avg_sq": v * 0}
                for n, v in engine.full_state_dict().items()
                if n != "lm_head.weight"
            },
            "param_groups": [{"lr": Payload(), "params": []}],
        },
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    with pytest.raises(CheckpointError, match="not plain data"):
        engine.load_checkpoint(tmp_path / "bad")
    assert not marker.exists()
    engine.close()


def test_a_deepspeed_checkpoint_exports_to_the_same_state(tmp_path):
    from zero_offload.checkpoint import export_dcp

    fixture = Path(__file__).parent / "data" / "deepspeed" / "s2w2"
    export_dcp(fixture, tmp_path / "dcp", model_key="model", optim_key="optimizer")
    engines = []
    for folder in (fixture, tmp_path / "dcp"):
        model = TinyGPT(width=WIDTH)
        model.get_parameter("wpe.weight").requires_grad_(False)
        engine = zo.initialize(model, stage=2, lr=LR, weight_decay=WD, max_grad_norm=CLIP)
        engine.load_checkpoint(folder)
        engines.append(engine)
    a, b = (training_state(e) for e in engines)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert engines[0].optimizer.param_groups[0]["lr"] == engines[1].optimizer.param_groups[0]["lr"]
    for engine in engines:
        engine.close()


@pytest.mark.parametrize(
    "kind,moments",
    [("adagrad", {"sum"}), ("lion", {"exp_avg"}), ("adam", {"exp_avg", "exp_avg_sq"})],
)
def test_other_optimizers_export_in_their_own_layout_and_load_back(tmp_path, kind, moments):
    """Adagrad's sum is exported as torch.optim.Adagrad's ``sum`` (equal to torch's after the
    same steps), Lion's momentum as ``exp_avg`` (as Lion implementations for torch name it),
    never as an Adam state with a zero moment; the folder loads back into an engine of the
    same kind exactly as the checkpoint it came from."""
    from torch.distributed.checkpoint import FileSystemReader, load

    from zero_offload.checkpoint import export_dcp

    kw = dict(stage=2, lr=LR, weight_decay=WD, optimizer_type=kind)
    torch.manual_seed(0)
    model = TinyGPT(width=WIDTH)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zo.initialize(model, **kw)

    def backward(e):
        return lambda loss: (e.backward(loss), e.step())

    _steps(0, 1, engine, backward(engine), 0, SAVE_AT)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    export_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    meta = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    state_keys = [k for k in meta if k.startswith("optim.state.")]
    assert {k.rsplit(".", 1)[1] for k in state_keys} == moments | {"step"}

    if kind == "adagrad":  # the values are torch's Adagrad state after the same steps
        reference = TinyGPT(width=WIDTH)
        reference.load_state_dict(initial)
        opt = torch.optim.Adagrad(reference.parameters(), lr=LR, weight_decay=WD, eps=1e-10)

        def torch_backward(loss):
            loss.backward()
            opt.step()
            opt.zero_grad()

        _steps(0, 1, reference, torch_backward, 0, SAVE_AT)
        names = dict(reference.named_parameters())
        exported = {k: torch.empty(tuple(meta[k].size)) for k in state_keys if k.endswith(".sum")}
        load(exported, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        for key, got in exported.items():
            want = opt.state[names[key[len("optim.state.") : -len(".sum")]]]["sum"]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-12), key

    resumed = []
    for folder in ("ckpt", "dcp"):
        torch.manual_seed(5)
        e = zo.initialize(TinyGPT(width=WIDTH), **kw)
        e.load_checkpoint(tmp_path / folder)
        _steps(0, 1, e, backward(e), SAVE_AT, STEPS)
        resumed.append(training_state(e))
        e.close()
    a, b = resumed
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_refused_load_changes_nothing(tmp_path):
    """A checkpoint refused for its param groups (two learning rates) is refused before any
    parameter or moment is written: the engine is as it was, not half loaded."""
    from torch.distributed.checkpoint import save

    model = TinyGPT(width=WIDTH)
    named = dict(model.named_parameters())
    names = list(named)
    state = {
        n: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.ones_like(p),
            "exp_avg_sq": torch.ones_like(p),
        }
        for n, p in named.items()
    }
    hyper = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    groups = [dict(hyper, lr=0.1, params=names[:1]), dict(hyper, lr=0.2, params=names[1:])]
    model_sd = {n: p.detach() + 1 for n, p in named.items()}
    sd = {"model": model_sd, "optim": {"state": state, "param_groups": groups}}
    save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.manual_seed(0)
    engine = zo.initialize(TinyGPT(width=WIDTH), stage=2, lr=LR)
    before = training_state(engine)
    with pytest.raises(CheckpointError, match="different lr"):
        engine.load_checkpoint(tmp_path / "dcp")
    after = training_state(engine)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
