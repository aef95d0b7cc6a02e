"""What zero_offload does with every key of a DeepSpeed config: one table, decided once.

Each :class:`Key` is a DeepSpeed config key (dotted, as in ``zero_optimization.stage``) or a
whole section (``flops_profiler``: every key under it) with one :class:`Decision`:

- ``TRANSLATED``: it becomes :func:`zero_offload.initialize` keywords (``ds_config`` does it);
- ``ACCEPTED``: its job is done here already, or it does not change training; taken with one
  log line saying why it is not needed;
- ``REFUSED``: it would change training in a way zero_offload cannot honour; a
  :class:`~zero_offload.errors.ConfigError` says so, unless its value is one of ``off`` (the
  values that leave the feature off, accepted with a log line). A refused section is off when
  every ``enabled`` inside it is false.

``aliases`` are DeepSpeed's other names for the key (``stage3_max_live_parameters`` for
``max_live_parameters``); ``default`` is DeepSpeed's value when the key is absent, which is
also what ``"auto"`` means outside a trainer inside the sections DeepSpeed validates
(:data:`VALIDATED`). ``docs/deepspeed.md`` is written from this table (``python -m
zero_offload.ds_keys``) and a test checks that it is current.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Decision", "Key", "KEYS", "VALIDATED", "counts", "find", "markdown"]


class Decision(enum.Enum):
    TRANSLATED = "translated"
    ACCEPTED = "accepted"
    REFUSED = "refused"


@dataclass(frozen=True)
class Key:
    path: str
    decision: Decision
    why: str
    aliases: tuple[str, ...] = ()
    off: tuple[Any, ...] = ()
    default: Any = None


T, A, R = Decision.TRANSLATED, Decision.ACCEPTED, Decision.REFUSED
_Z = "zero_optimization."
_OO = _Z + "offload_optimizer."
_OP = _Z + "offload_param."

# reasons shared by several keys
_SIZED = "zero_offload sizes its buffers, I/O and threads from the model and the memory budget"
_FREED = "gathered parameters are freed as soon as their module has run"
_GATHER_SAVE = "save_model, full_state_dict() and consolidate_checkpoint gather the fp32 masters"
_COMM = "a choice of collective: the same sums, reduced as zero_offload schedules them"
_ROUNDING = "where the 1/world factor of the average is applied changes only rounding"
_LOGS = "zero_offload logs through Python logging and your trainer's loggers (engine.last_step)"
_TORCH_IMPL = "an implementation choice of torch's AdamW: zero_offload runs its own AdamW kernels"
_MODEL_BUILT = "for modules a model builds from DeepSpeed; zero_offload trains the model as it is"
_BATCH = (
    "with the other batch keys and the world size it gives gradient_accumulation_steps, as in "
    "DeepSpeed (and is checked against them); the batch itself is your data loader's"
)

KEYS: tuple[Key, ...] = (
    # -- batch and accumulation ------------------------------------------------------------
    Key("train_batch_size", T, _BATCH),
    Key("train_micro_batch_size_per_gpu", T, _BATCH),
    Key("gradient_accumulation_steps", T, "gradient_accumulation_steps", default=1),
    Key(
        "managed_gradient_accumulation",
        R,
        "false leaves the accumulation boundary to the caller's step(); with zero_offload say "
        "it per backward: gradient_accumulation_steps=1 and engine.backward(loss, final=...)",
        off=(True,),
        default=True,
    ),
    Key(
        "gradient_clipping",
        T,
        "max_grad_norm (0: no clipping); absent, 1.0 as DeepSpeed since 0.19.3",
        default=1.0,
    ),
    # -- optimizer -------------------------------------------------------------------------
    Key(
        "optimizer.type",
        T,
        "Adam and AdamW run zero_offload's AdamW; any other optimizer is a ConfigError",
    ),
    Key("optimizer.params.lr", T, "lr", default=1e-3),
    Key("optimizer.params.betas", T, "betas", default=(0.9, 0.999)),
    Key("optimizer.params.eps", T, "eps", default=1e-8),
    Key(
        "optimizer.params.weight_decay",
        T,
        "weight_decay (absent: 0, DeepSpeed's FusedAdam/CPUAdam default; 0.01 with torch_adam)",
        default=0.0,
    ),
    Key(
        "optimizer.params.adam_w_mode",
        T,
        "true (the default) is AdamW, decoupled weight decay; false (L2 added to the gradient) "
        "is a ConfigError",
        default=True,
    ),
    Key("optimizer.params.amsgrad", R, "AMSGrad keeps a running max of v", off=(False,)),
    Key(
        "optimizer.params.bias_correction",
        R,
        "Adam without bias correction takes other steps",
        off=(True,),
        default=True,
    ),
    Key("optimizer.params.maximize", R, "ascends the objective", off=(False,)),
    Key("optimizer.params.torch_adam", T, "selects torch's AdamW (weight_decay default 0.01)"),
    Key("optimizer.params.fused", A, _TORCH_IMPL),
    Key("optimizer.params.foreach", A, _TORCH_IMPL),
    Key("optimizer.params.capturable", A, _TORCH_IMPL),
    Key("optimizer.params.differentiable", A, _TORCH_IMPL),
    Key("optimizer.legacy_fusion", A, "an fp16 optimizer implementation choice"),
    Key(
        "scheduler",
        T,
        "lr_schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR; zero_offload.ds_schedules): "
        "engine.lr_scheduler, stepped after each applied update; ZeroOffloadTrainer and "
        "ZeroOffloadStrategy run it as their lr scheduler",
    ),
    Key("zero_allow_untested_optimizer", A, "zero_offload runs its own AdamW"),
    Key(
        "zero_force_ds_cpu_optimizer",
        A,
        "offloaded shards always step in zero_offload's CPU AdamW",
    ),
    # -- precision -------------------------------------------------------------------------
    Key("fp16.enabled", T, "dtype=float16, with the dynamic loss scaler", default=False),
    Key(
        "fp16.loss_scale",
        T,
        "0: dynamic loss scaling; a static scale is a ConfigError (the scaler is dynamic)",
        default=0,
    ),
    Key("fp16.initial_scale_power", T, "initial_loss_scale = 2**power", default=16),
    Key(
        "fp16.loss_scale_window",
        T,
        "loss_scale_window (zero_offload doubles after that many overflow-free steps; "
        "DeepSpeed after one more following an overflow)",
        default=1000,
    ),
    Key("fp16.min_loss_scale", T, "min_loss_scale", default=1),
    Key(
        "fp16.hysteresis",
        T,
        "loss_scale_hysteresis: overflows the scale absorbs before it halves",
        default=2,
    ),
    Key(
        "fp16.consecutive_hysteresis",
        T,
        "consecutive_hysteresis: an overflow-free step refills the hysteresis",
        default=False,
    ),
    Key("fp16.auto_cast", A, "the engine casts floating inputs to the compute dtype always"),
    Key(
        "fp16.fp16_master_weights_and_grads",
        R,
        "fp16 master weights round every update; zero_offload keeps fp32 masters",
        off=(False,),
        default=False,
    ),
    Key(
        "bf16.enabled",
        T,
        "dtype=bfloat16",
        aliases=("bfloat16.enabled",),
        default=False,
    ),
    Key(
        "bf16.check_grad_overflow",
        T,
        "skip_nonfinite_steps: a step whose gradients hold inf/NaN is skipped",
        aliases=("bfloat16.check_grad_overflow",),
        default=True,
    ),
    Key(
        "bf16.immediate_grad_update",
        A,
        "when DeepSpeed's bf16 optimizer copies gradients into fp32: zero_offload reduces "
        "them into its own buffers (see data_types.grad_accum_dtype)",
        aliases=("bfloat16.immediate_grad_update",),
    ),
    Key(
        "bf16.bf16_master_weights_and_grads",
        R,
        "bf16 master weights round every update; zero_offload keeps fp32 masters",
        aliases=("bfloat16.bf16_master_weights_and_grads",),
        off=(False,),
        default=False,
    ),
    Key(
        "bf16.bf16_optimizer_states",
        R,
        "bf16 Adam moments; zero_offload keeps them in fp32",
        aliases=("bfloat16.bf16_optimizer_states",),
        off=(False,),
        default=False,
    ),
    Key(
        "data_types.grad_accum_dtype",
        T,
        "checked against zero_offload's: fp32 when the optimizer is offloaded or training is "
        "fp32, the compute dtype for an optimizer on the device; another is a ConfigError",
    ),
    Key("data_types.param_dtype", A, "parameters train in the compute dtype (fp16/bf16.enabled)"),
    Key("data_types.buffer_dtype", A, "module buffers keep the dtype the model gives them"),
    Key("amp", R, "NVIDIA Apex AMP: use fp16 or bf16 instead"),
    Key(
        "torch_autocast",
        R,
        "keeps fp32 parameters and runs ops under torch.autocast; zero_offload computes in its "
        "dtype: use bf16.enabled (or an fp32 engine and torch.autocast in your own forward)",
    ),
    Key("communication_data_type", A, "gradients are reduced in their buffers' dtype"),
    Key("seq_parallel_communication_data_type", A, "for sequence parallelism only"),
    Key("prescale_gradients", A, _ROUNDING),
    Key("gradient_predivide_factor", A, _ROUNDING),
    Key(
        "gradient_allreduce_op",
        R,
        "'sum' steps on the sum over ranks, not the average",
        off=("mean",),
        default="mean",
    ),
    # -- ZeRO ------------------------------------------------------------------------------
    Key(_Z + "stage", T, "stage", default=0),
    Key(_Z + "cpu_offload", T, "true: offload_optimizer='cpu' (DeepSpeed's older name)"),
    Key(_Z + "cpu_offload_param", T, "true: offload_param='cpu' (DeepSpeed's older name)"),
    Key(_Z + "cpu_offload_use_pin_memory", A, _SIZED),
    Key(_OO + "device", T, "offload_optimizer", default="none"),
    Key(_OO + "nvme_path", T, "nvme_path (one folder for both tiers)"),
    Key(
        _OO + "ratio",
        A,
        "DeepSpeed keeps the other part on the GPU; zero_offload offloads a rank's whole "
        "optimizer state (offload_optimizer_fraction splits NVMe and host memory instead)",
        default=1.0,
    ),
    Key(_OO + "pin_memory", A, _SIZED),
    Key(_OO + "buffer_count", A, _SIZED),
    Key(_OO + "fast_init", A, _SIZED),
    Key(_OO + "pipeline_read", A, "sub-group reads and writes are always pipelined"),
    Key(_OO + "pipeline_write", A, "sub-group reads and writes are always pipelined"),
    Key(_OO + "super_offload", A, "a Superchip schedule of DeepSpeed's CPU offload"),
    Key(_OO + "cpuadam_cores_perc", A, _SIZED),
    Key(_OP + "device", T, "offload_param", default="none"),
    Key(_OP + "nvme_path", T, "nvme_path (one folder for both tiers)"),
    Key(_OP + "pin_memory", A, _SIZED),
    Key(_OP + "buffer_count", A, _SIZED),
    Key(_OP + "buffer_size", A, _SIZED),
    Key(_OP + "max_in_cpu", A, _SIZED),
    Key(
        _Z + "sub_group_size",
        T,
        "sub_group_size (a cap: sub-groups are sized to the host budget); 0, DeepSpeed's one "
        "parameter per sub-group, leaves them sized to the budget",
        default=1_000_000_000,
    ),
    Key(_Z + "reduce_bucket_size", T, "reduce_bucket_size (0: the smallest buckets)"),
    Key(
        _Z + "prefetch_bucket_size",
        T,
        "prefetch_bytes: DeepSpeed counts elements, zero_offload bytes of the compute dtype",
        aliases=(_Z + "stage3_prefetch_bucket_size",),
    ),
    Key(
        _Z + "param_persistence_threshold",
        T,
        "param_persistence_threshold",
        aliases=(_Z + "stage3_param_persistence_threshold",),
    ),
    Key(
        _Z + "model_persistence_threshold",
        A,
        "caps the persistent parameters in total; zero_offload's threshold is per module",
        aliases=(_Z + "stage3_model_persistence_threshold",),
    ),
    Key(_Z + "max_live_parameters", A, _FREED, aliases=(_Z + "stage3_max_live_parameters",)),
    Key(_Z + "max_reuse_distance", A, _FREED, aliases=(_Z + "stage3_max_reuse_distance",)),
    Key(
        _Z + "gather_16bit_weights_on_model_save",
        A,
        _GATHER_SAVE,
        aliases=(_Z + "stage3_gather_16bit_weights_on_model_save",),
    ),
    Key(_Z + "stage3_gather_fp16_weights_on_model_save", A, _GATHER_SAVE),
    Key(
        _Z + "module_granularity_threshold",
        A,
        "stage 3 gathers one unit per module, with the parameters a module reads from others",
        aliases=(_Z + "stage3_module_granularity_threshold",),
    ),
    Key(
        _Z + "use_all_reduce_for_fetch_params",
        A,
        _COMM,
        aliases=(_Z + "stage3_use_all_reduce_for_fetch_params",),
    ),
    Key(_Z + "allgather_sequential", A, _COMM, aliases=(_Z + "stage3_allgather_sequential",)),
    Key(_Z + "overlap_comm", A, "zero_offload overlaps its reductions with the backward itself"),
    Key(_Z + "contiguous_gradients", A, "gradients always land in one flat buffer per unit"),
    Key(_Z + "reduce_scatter", A, _COMM),
    Key(_Z + "allgather_partitions", A, _COMM),
    Key(_Z + "allgather_bucket_size", A, "updated parameters are gathered unit by unit"),
    Key(_Z + "use_multi_rank_bucket_allreduce", A, _COMM),
    Key(_Z + "round_robin_gradients", A, "each rank's shard is contiguous"),
    Key(_Z + "load_from_fp32_weights", A, "checkpoints always resume from the fp32 masters"),
    Key(_Z + "elastic_checkpoint", A, "checkpoints load at any world size and stage"),
    Key(
        _Z + "ignore_unused_parameters",
        A,
        "a parameter without a gradient is skipped by the step, as torch's AdamW skips it",
    ),
    Key(_Z + "legacy_stage1", A, "an older implementation of the same stage 1"),
    Key(_Z + "grad_hooks", A, "gradients are always reduced from autograd hooks"),
    Key(
        _Z + "zero_hpz_partition_size",
        A,
        "ZeRO++ keeps a node-local copy of the parameters for faster gathers; zero_offload "
        "shards over the whole group",
    ),
    Key(
        _Z + "zero_quantized_weights",
        R,
        "ZeRO++ gathers int8 weights: the forward sees quantized weights",
        off=(False,),
    ),
    Key(
        _Z + "zero_quantized_nontrainable_weights",
        R,
        "frozen weights are stored quantized",
        off=(False,),
    ),
    Key(
        _Z + "zero_quantized_gradients",
        R,
        "ZeRO++ reduces int4 gradients",
        off=(False,),
    ),
    Key(_Z + "zeropp_loco_param", A, "used only with zero_quantized_gradients (refused when on)"),
    Key(_Z + "mics_shard_size", A, "MiCS shards within sub-groups; zero_offload over the group"),
    Key(_Z + "mics_hierarchical_params_gather", A, _COMM),
    Key(_Z + "memory_efficient_linear", A, "zero_offload does not replace nn.Linear"),
    Key(_Z + "pipeline_loading_checkpoint", A, "checkpoints load unit by unit always"),
    Key(
        _Z + "override_module_apply",
        A,
        "zero_offload patches no module method; parameters are materialized unit by unit",
    ),
    Key(_Z + "log_trace_cache_warnings", A, _LOGS),
    Key(_Z + "enable_sanity_checks", A, "internal checks of DeepSpeed's stage 3"),
    Key(_Z + "save_muon_momentum_buffer_in_memory", A, "for Muon only (refused as optimizer)"),
    Key(
        _Z + "leaf_module",
        A,
        "stage 3 gathers per module and finds parameters a module reads from another one",
    ),
    Key(
        _Z + "zenflow",
        R,
        "ZenFlow updates the top-k gradient columns each step and the rest asynchronously: "
        "another optimizer",
    ),
    Key("aio", A, _SIZED, aliases=(_Z + "aio",)),  # some guides put it under zero_optimization
    # -- parallelism zero_offload does not do ----------------------------------------------
    Key(
        "tensor_parallel.autotp_size",
        R,
        "tensor parallelism splits layers across ranks (which then share one batch); "
        "zero_offload is data-parallel",
        off=(0, 1),
        default=0,
    ),
    Key("tensor_parallel", A, "used only with autotp_size above 1 (refused)"),
    Key("expert_parallel", R, "expert parallelism places MoE experts on ranks"),
    Key(
        "sequence_parallel_size",
        R,
        "sequence parallelism splits each sequence across ranks",
        off=(1,),
        default=1,
    ),
    Key("data_parallel_size", A, "zero_offload is data-parallel over the whole group"),
    Key("use_data_before_expert_parallelism", A, "for expert parallelism only"),
    Key("pipeline", A, "settings of DeepSpeed's PipelineModule; " + _MODEL_BUILT),
    # -- features that change what a step computes -----------------------------------------
    Key("elasticity", R, "elastic training picks batch sizes from the world size: set them"),
    Key("progressive_layer_drop", R, "drops layers from the forward on a schedule"),
    Key("compression_training", R, "quantizes and prunes the model during training"),
    Key("quantize_training", R, "MoQ quantizes the weights during training"),
    Key("weight_quantization", R, "quantizes the weights at load (ZeRO-Inference)"),
    Key("data_efficiency", R, "curriculum learning and random-LTD change what each step sees"),
    Key("curriculum_learning", R, "changes what each step sees (sequence-length curriculum)"),
    Key("eigenvalue", A, "feeds MoQ's schedule (quantize_training, refused when on)"),
    # -- accepted as they are: no effect on training ---------------------------------------
    Key("activation_checkpointing", A, "applies to models that call deepspeed.checkpointing"),
    Key("sparse_attention", A, _MODEL_BUILT),
    Key("hybrid_engine", A, "DeepSpeed-Chat's generation kernels; " + _MODEL_BUILT),
    Key("compile", A, "DeepSpeed compiles in engine.compile(); compile your model yourself"),
    Key("graph_harvesting", A, "CUDA graph capture of DeepSpeed's kernels"),
    Key("sparse_gradients", A, "embedding gradients are reduced dense: the same sums"),
    Key("disable_allgather", A, _COMM),
    Key("steps_per_print", A, _LOGS),
    Key("wall_clock_breakdown", A, "step timings are always in engine.last_step"),
    Key("memory_breakdown", A, "memory is in engine.last_step and zero-offload plan"),
    Key("dump_state", A, _LOGS),
    Key("log_level", A, _LOGS),
    Key("flops_profiler", A, "profiling; torch.profiler works on the engine as on any model"),
    Key("autotuning", A, "read by DeepSpeed's launcher; zero-offload plan picks settings"),
    Key("comms_logger", A, _LOGS),
    Key("tensorboard", A, _LOGS),
    Key("wandb", A, _LOGS),
    Key("csv_monitor", A, _LOGS),
    Key("comet", A, _LOGS),
    Key("timers", A, _LOGS),
    Key("checkpoint", A, "zero_offload writes its own checkpoint format (any world size)"),
    Key("nebula", A, "an asynchronous checkpoint service of DeepSpeed"),
    Key("datastates_ckpt", A, "an asynchronous checkpoint service of DeepSpeed"),
    Key(
        "dataloader_drop_last",
        A,
        "for loaders deepspeed.initialize builds; your data loader is your own",
    ),
)

# Sections DeepSpeed parses with its validating config models: "auto" in them is DeepSpeed's
# default (the models drop it), and a key they do not know is an error there too.
VALIDATED = (
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "compile",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "hybrid_engine",
    "timers",
)

_BY_PATH: dict[str, Key] = {}
for _key in KEYS:
    for _name in (_key.path, *_key.aliases):
        assert _name not in _BY_PATH, _name
        _BY_PATH[_name] = _key


def find(path: str) -> Key | None:
    """The entry deciding ``path``: its own, or that of the nearest section above it."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        key = _BY_PATH.get(".".join(parts[:n]))
        if key is not None:
            return key
    return None


def counts() -> dict[str, int]:
    """How many entries of the table have each decision."""
    out = {d.value: 0 for d in Decision}
    for key in KEYS:
        out[key.decision.value] += 1
    return out


def markdown() -> str:
    """The table as the Markdown rows of ``docs/deepspeed.md``."""
    lines = ["| key | decision | what zero_offload does |", "|---|---|---|"]
    for key in KEYS:
        names = " ≡ ".join(f"`{n}`" for n in (key.path, *key.aliases))
        decision = key.decision.value
        if key.off:
            decision += " (accepted at " + ", ".join(f"`{_json(v)}`" for v in key.off) + ")"
        lines.append(f"| {names} | {decision} | {key.why} |")
    c = counts()
    lines.append("")
    lines.append(
        f"{len(KEYS)} entries: {c['translated']} translated, {c['accepted']} accepted, "
        f"{c['refused']} refused."
    )
    return "\n".join(lines) + "\n"


def _json(value: Any) -> str:
    return json.dumps(value)
