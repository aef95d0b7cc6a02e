"""One source for every size: the memory model adds up what the components' own sizing
functions say (the functions their constructors call), and re-defines no count or rule."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import zero_offload as zo
from zero_offload.config import build_config
from zero_offload.grads.host import staging_bytes
from zero_offload.grads.reducer import reductions_alive
from zero_offload.memory.sizes import pool_bytes
from zero_offload.params.module_units import gathered_units
from zero_offload.params.sizing import WRITE_BACK_BUFFERS
from zero_offload.params.units import unit_build_bytes
from zero_offload.partition import build_layout, padded_numel
from zero_offload.planning.estimate import builder as memory_builder
from zero_offload.planning.estimate import memory as memory_model
from zero_offload.planning.estimate import optimizer_terms
from zero_offload.planning.estimate import result as memory_result
from zero_offload.planning.estimate import shape as memory_shape
from zero_offload.planning.estimate import terms as memory_terms
from zero_offload.swap.buffers import BufferPool, pool_count, pool_footprint
from zero_offload.update.nvme.adam import NvmeAdam


def _term(e: memory_model.MemoryEstimate, name: str) -> int:
    return sum(t.bytes for t in e.terms if t.name == name)


def test_memory_model_defines_no_count_of_its_own() -> None:
    """Its module-level numbers are planning assumptions only (what to assume without a
    model), and it does no arithmetic on an engine setting: a count derived from
    ``prefetch_depth`` (buffers, units gathered) belongs to the component that allocates it.
    The modules of the terms the estimate adds up, their builder and the estimate it returns
    are held to the same rules."""
    numbers: set[str] = set()
    derived: list[str] = []
    for module in (
        memory_model,
        memory_terms,
        memory_builder,
        optimizer_terms,
        memory_result,
        memory_shape,
    ):
        tree = ast.parse(Path(module.__file__).read_text())
        numbers |= {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and type(node.value.value) in (int, float)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        derived += [
            ast.unparse(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.BinOp)
            and "prefetch_depth" in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            and not isinstance(node.op, ast.Mult)
        ]
    assert numbers == {"_DEFAULT_LARGEST_FRACTION"}
    assert derived == []


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_stage3_terms_are_the_gatherer_and_param_pool_sizes(depth: int) -> None:
    largest, gpus, b = 50_000_000, 4, 2

    def estimate(optimizer: str):
        return zo.estimate_memory(
            2e9,
            num_gpus=gpus,
            stage=3,
            offload_optimizer=optimizer,
            offload_param="nvme",
            largest_layer_params=largest,
            prefetch_depth=depth,
            host_memory_limit=64 * 2**30,
        )

    e, nvme = estimate("cpu"), estimate("nvme")
    assert _term(e, "gathered params") == gathered_units(depth) * largest * b
    shard_bytes = b * math.ceil(largest / gpus)
    # the optimizer in host memory: no update writes parameters back beside the passes
    assert _term(e, "param swap buffers") == (depth + 2) * pool_footprint(shard_bytes)
    assert _term(nvme, "param swap buffers") == (depth + 2 + WRITE_BACK_BUFFERS) * pool_footprint(
        shard_bytes
    )
    assert _term(e, "grad staging") == staging_bytes(math.ceil(largest / gpus), b)
    assert _term(e, "unit being made") == unit_build_bytes(largest, math.ceil(largest / gpus), b)


def test_reductions_in_flight_are_the_reducers() -> None:
    e = zo.estimate_memory(1e9, num_gpus=8, stage=2, reduce_bucket_size=10_000_000)
    assert _term(e, "grad reductions in flight") == reductions_alive() * 10_000_000 * 2


def test_padding_is_the_layouts() -> None:
    for numel in (1, 63, 64, 65, 1000, 4097, 123_457):
        for shards in (1, 2, 3, 8):
            assert (
                padded_numel(numel, shards)
                == build_layout([("w", torch.Size([numel]))], shards).padded_numel
            )


def test_pool_size_under_a_budget_is_the_pools(tmp_path: Path) -> None:
    """The estimate's pool rule is BufferPool's: as many buffers as the budget holds, each
    rounded as the pool rounds it."""
    for buffer_bytes, wanted, limit in (
        (10_000, 4, 10**6),
        (10_000, 4, 25_000),
        (5000, 3, 8192 * 2 + 1),
    ):
        pool = BufferPool(buffer_bytes, wanted, host_memory_limit=limit, pin=False)
        try:
            assert pool.count == pool_count(pool_footprint(buffer_bytes), wanted, limit)
            assert pool.nbytes == pool_bytes(buffer_bytes, wanted, limit)
        finally:
            pool.close()


@pytest.mark.parametrize("limit_mib", [60, 400])  # gradients in files / in host memory
def test_nvme_terms_are_the_nvme_optimizers_pools(tmp_path: Path, limit_mib: int) -> None:
    """The estimate's NVMe terms equal the host memory a real NvmeAdam of the same shard and
    budget holds (its pools and output buffer), with gradients on disk and off."""
    numel, limit = 20_000_000, limit_mib * 2**20
    e = zo.estimate_memory(
        numel,
        num_gpus=1,
        stage=2,
        offload_optimizer="nvme",
        dtype=torch.bfloat16,
        host_memory_limit=limit,
        device="cpu",
    )
    cfg = build_config(
        stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path), dtype=torch.bfloat16
    )
    opt = NvmeAdam(numel, cfg, torch.bfloat16, 0, limit)
    try:
        assert (opt.disk_grads is not None) == (limit_mib == 60)
        assert _term(e, "optimizer swap buffers") == opt.swapper.host_buffer_nbytes
        grads = opt.disk_grads.swapper.host_buffer_nbytes if opt.disk_grads else 0
        assert _term(e, "grad swap buffers") == grads
        out = opt.group_step.out
        assert _term(e, "param staging") == out.numel() * out.element_size()
    finally:
        opt.close()


def test_the_optimizer_states_bytes_per_element_is_one_named_constant() -> None:
    """fp32 AdamW's 12 bytes an element (master, m, v) is ``ADAM_STATE_BYTES``, the default
    policy's size; no code multiplies by a bare 12 (a change of layout would miss it). The
    GPT shape rule (12 · width² weights a layer) is not a state size."""
    from zero_offload.optim.policy import ADAM_STATE_BYTES, StatePolicy

    assert StatePolicy().bytes_per_param == ADAM_STATE_BYTES == 12
    package = Path(zo.__file__).resolve().parent
    bare = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                for side in (node.left, node.right):
                    if isinstance(side, ast.Constant) and side.value in (12, 12.0):
                        if "width" in ast.unparse(node):
                            continue
                        bare.append(f"{path.relative_to(package)}:{node.lineno}")
    assert bare == []
