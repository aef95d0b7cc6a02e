#!/usr/bin/env bash
# torchrun --no-python entry: each process sees only the GPU of its LOCAL_RANK (as SLURM's
# --gpus-per-task does), then runs python with the given arguments.
export CUDA_VISIBLE_DEVICES="$LOCAL_RANK"
exec "${ZO_PYTHON:-python}" "$@"
