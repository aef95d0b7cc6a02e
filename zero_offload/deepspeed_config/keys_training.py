"""The DeepSpeed keys of a training step: batch and accumulation, the optimizer, precision."""

from __future__ import annotations

from .key import BATCH, ROUNDING, TORCH_IMPL, A, Key, R, T

__all__ = ["TRAINING_KEYS"]

TRAINING_KEYS: tuple[Key, ...] = (
    # -- batch and accumulation ------------------------------------------------------------
    Key("train_batch_size", T, BATCH),
    Key("train_micro_batch_size_per_gpu", T, BATCH),
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
        "optimizer_type: Adam and AdamW (adamw), Lion (lion), Adagrad (adagrad), with the defaults "
        "of DeepSpeed's CPU classes for them; any other optimizer is a ConfigError",
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
        "with type Adam: true (the default) is AdamW, decoupled weight decay; false is "
        "optimizer_type='adam' (L2 decay added to the gradient, as torch.optim.Adam); type "
        "AdamW stays AdamW whatever it says, as in DeepSpeed; Lion and Adagrad take no such key",
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
    Key(
        "optimizer.params.torch_adam",
        T,
        "selects torch's AdamW (weight_decay default 0.01), or with type Adam and adam_w_mode "
        "false torch.optim.Adam (default 0); Lion and Adagrad take no such key",
    ),
    Key(
        "optimizer.params.fp32_optimizer_states",
        R,
        "false keeps DeepSpeed's CPU optimizer moments in the parameter dtype; zero_offload's "
        "moment_precision='bf16' keeps bf16 moments (stochastically rounded)",
        off=(True,),
        default=True,
    ),
    Key(
        "optimizer.params.set_grad_none",
        A,
        "whether FusedAdam/FusedLion's zero_grad frees or zeroes gradients: zero_offload "
        "manages its gradient buffers itself",
    ),
    Key("optimizer.params.fused", A, TORCH_IMPL),
    Key("optimizer.params.foreach", A, TORCH_IMPL),
    Key("optimizer.params.capturable", A, TORCH_IMPL),
    Key("optimizer.params.differentiable", A, TORCH_IMPL),
    Key("optimizer.legacy_fusion", A, "an fp16 optimizer implementation choice"),
    Key(
        "scheduler",
        T,
        "lr_schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR; "
        "zero_offload.deepspeed_config.schedules): "
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
    Key("prescale_gradients", A, ROUNDING),
    Key("gradient_predivide_factor", A, ROUNDING),
    Key(
        "gradient_allreduce_op",
        R,
        "'sum' steps on the sum over ranks, not the average",
        off=("mean",),
        default="mean",
    ),
)
