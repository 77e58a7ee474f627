#!/usr/bin/env bash
# Megatron backend on a lent GPU: NCCL, bf16, one rank per device. Nothing is patched on CUDA
# (relax_agent/train/megatron/cpu.py applies its patches only when CUDA is absent).
#   bash scripts/gpu_check_megatron.sh            # needs .venv with relax-agent[dev] (megatron-core)
# Runs: the gpu-marked test (one bf16 train step through NCCL), then the benchmark on one GPU
# (tiny and SmolLM2-shaped, TP=1, bf16) against the torch backend on the same device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name(0), 'bf16:', torch.cuda.is_bf16_supported())"
"$PY" -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
timeout 300 "$PY" -m pytest -q -m gpu tests/e2e/test_megatron_backend.py -p no:cacheprovider
timeout 300 "$PY" benchmarks/megatron.py --device cuda --dtype bf16 --tp 1 --steps 5 --batch 8 --seq-len 512 --micro-batch 8
