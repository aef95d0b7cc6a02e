#!/usr/bin/env bash
# The CUDA-path check, for a machine with a GPU (about 7 minutes at most): the GPU line,
# tests/gpu, then `bench step` for optimizer offload none / cpu / nvme on a ~100M-param model
# and a stage-3 prefetch-depth sweep with parameters offloaded to host memory.
# Installs only what is missing. Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/../.."

nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader \
    || echo "check.sh: nvidia-smi failed"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available:', torch.cuda.is_available(), 'devices:', torch.cuda.device_count())"
python -c "import zero_offload" 2>/dev/null || pip install -q --no-deps -e .
python -c "import pytest" 2>/dev/null || pip install -q pytest

status=0
echo "== python -m pytest -q tests/gpu"
timeout 240 python -m pytest -q -rs --durations=5 tests/gpu || status=1

# The swap files must be on a disk: /tmp unless it is a memory filesystem there.
base=/tmp
case "$(findmnt -no FSTYPE -T /tmp 2>/dev/null)" in tmpfs|ramfs) base="$PWD";; esac
nvme="$(mktemp -d "$base/zo_bench_step.XXXXXX")"
trap 'rm -rf "$nvme"' EXIT

echo "== bench step: optimizer offload none / cpu / nvme (nvme path $nvme)"
timeout 100 python -m zero_offload.bench.step --params 1e8 --offload-optimizer none cpu nvme \
    --nvme-path "$nvme" --steps 3 --warmup 1 --baseline-size 512MiB || status=1
echo "== bench step: prefetch-depth sweep, params offloaded to host memory"
timeout 60 python -m zero_offload.bench.step --params 1e8 --offload-optimizer cpu --offload-param cpu \
    --prefetch-depth 0 1 2 4 --steps 3 --warmup 1 || status=1
echo "check.sh: exit $status"
exit $status
