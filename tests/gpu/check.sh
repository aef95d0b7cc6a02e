#!/usr/bin/env bash
# The CUDA-path check, for a machine with a GPU (under 10 minutes on one GPU): the GPU line,
# tests/gpu (equivalence, streams late and under the CUDA sanitizer, device memory under a
# cap, pinned host memory against the ledger, host waits, torchrun ranks with 2 GPUs), then
# `bench step` for optimizer offload none / cpu / nvme on a ~100M-param model and a stage-3
# prefetch-depth sweep with parameters offloaded to host memory. Ends with one summary table
# (each test, its outcome, seconds and what it measured). Installs only what is missing.
# Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/../.."

nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader \
    || echo "check.sh: nvidia-smi failed"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available:', torch.cuda.is_available(), 'devices:', torch.cuda.device_count())"
python -c "import zero_offload" 2>/dev/null || pip install -q --no-deps -e .
python -c "import pytest" 2>/dev/null || pip install -q pytest

# The swap files must be on a disk: /tmp unless it is a memory filesystem there.
base=/tmp
case "$(findmnt -no FSTYPE -T /tmp 2>/dev/null)" in tmpfs|ramfs) base="$PWD";; esac
work="$(mktemp -d "$base/zo_gpu_check.XXXXXX")"
trap 'rm -rf "$work"' EXIT

status=0
echo "== python -m pytest tests/gpu"
# one process (-o addopts= drops the suite's xdist workers): the tests share one GPU and
# measure its memory
timeout 390 python -m pytest -q -rs --durations=5 -p no:cacheprovider -o addopts= \
    --junitxml="$work/gpu.xml" -o junit_family=xunit1 --basetemp="$work/pytest" tests/gpu \
    || status=1

benches=()
bench() {  # name, timeout, arguments...
    local name="$1" limit="$2"; shift 2
    echo "== bench step: $name"
    local start=$SECONDS rc=0
    timeout "$limit" python -m zero_offload.bench.training.step "$@" || rc=$?
    benches+=("$name|$([ $rc = 0 ] && echo passed || echo "failed (exit $rc)")|$((SECONDS - start))")
    [ $rc = 0 ] || status=1
}
bench "optimizer offload none/cpu/nvme" 90 --params 1e8 --offload-optimizer none cpu nvme \
    --nvme-path "$work" --steps 3 --warmup 1 --baseline-size 512MiB
bench "prefetch-depth sweep, params on host" 60 --params 1e8 --offload-optimizer cpu \
    --offload-param cpu --prefetch-depth 0 1 2 4 --steps 3 --warmup 1

echo
echo "== summary"
printf '%s\n' "${benches[@]}" > "$work/benches.txt"
python - "$work/gpu.xml" "$work/benches.txt" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

rows = []
xml = Path(sys.argv[1])
if xml.exists():
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                reason = (node.get("message") or "").splitlines()[0][:60] if node.get("message") else ""
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag] \
                    + (f": {reason}" if reason else "")
                break
        props = "; ".join(f"{p.get('name')}={p.get('value')}" for p in case.iter("property"))
        name = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "")
        rows.append((name, outcome, f"{float(case.get('time', 0)):.1f}", props))
else:
    rows.append(("tests/gpu", "NOT RUN (no report)", "", ""))
for line in Path(sys.argv[2]).read_text().splitlines():
    if line:
        name, outcome, secs = line.split("|")
        rows.append(("bench step: " + name, outcome, secs, ""))
width = max(len(r[0]) for r in rows)
print(f"{'check':<{width}}  {'outcome':<10}  {'s':>6}  measured")
for name, outcome, secs, props in rows:
    print(f"{name:<{width}}  {outcome:<10}  {secs:>6}  {props}")
counts = {}
for _, outcome, _, _ in rows:
    key = outcome.split(":")[0]
    counts[key] = counts.get(key, 0) + 1
print("totals: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
PY
echo "check.sh: exit $status"
exit $status
