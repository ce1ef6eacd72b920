#!/usr/bin/env bash
# The GPU acceptance run on the lent H200, one `device` call from the repo root (under 10 minutes):
#   run(command="bash benchmarks/gpu_acceptance.sh", carry=[".carry"], timeout_s=600)
# after `bash benchmarks/gpu_carry.sh` here once (it builds .carry/site.tgz: diffusers and the two pure-Python
# packages the image lacks, and checks that the working tree plus .carry stay far under the 64 MiB limit).
# What runs, section by section with its time budget: benchmarks/gpu_acceptance.py's header. The table and
# gpu_acceptance.json / .txt land in $OUT (benchmarks/results when OUT is unset).
# flash-attn cannot be installed there: every kernel examined is torch's own (aten flash, cuDNN, efficient).
# CI runs `python benchmarks/gpu_acceptance.py --dry-run` on a CPU (tests/integration/test_gpu_acceptance_dry_run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
if [ -f .carry/site.tgz ]; then
  mkdir -p /tmp/site && tar xzf .carry/site.tgz -C /tmp/site
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 570 python3 benchmarks/gpu_acceptance.py --out "${OUT:-benchmarks/results}" "$@"
