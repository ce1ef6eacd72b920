#!/usr/bin/env bash
# The GPU acceptance run on a lent GPU machine (one command, under 8 minutes): see benchmarks/gpu_acceptance.py.
#
# That machine reaches no registry and has torch (2.11, CUDA 13), typer, rich, pyyaml, huggingface_hub and
# safetensors, but not diffusers: carry diffusers as a wheel. Once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl diffusers==0.42.1 importlib_metadata zipp
# then run through the device tool, carrying .whl:  bash benchmarks/gpu_acceptance.sh
# cpdoctor itself travels as the working tree (PYTHONPATH); flash-attn cannot be had there, so `flash` is
# examined only emulated (cpdoctor check --emulate), never on that machine's kernels.
# CI runs `python benchmarks/gpu_acceptance.py --dry-run --layouts "ring 2"` on a CPU so this cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 470 python3 benchmarks/gpu_acceptance.py --out "${OUT:-benchmarks/results}" "$@"
