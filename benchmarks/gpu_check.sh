#!/usr/bin/env bash
# One prepared command for a lent CUDA GPU (see benchmarks/gpu_check.py): staged vs lazy export of a
# Qwen2.5-7B-shaped model with offloaded shards, the pinned-copy floor, time to the first tensor and
# peak GPU memory, one offload/load round with and without the pinned host pool; then fp32 masters exported as bf16 (cast before the gather, prefetch, grouped).
# Uses the machine's own torch/transformers (no install, no network); the whole run is bounded to
# 7.5 minutes so it fits an 8-minute budget with the machine's start. Tables last.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
timeout 300 python benchmarks/gpu_check.py "$@"
# fp32 masters exported as bf16 (cast before the gather, prefetch, grouped) on a 1.5B shape
timeout 150 python benchmarks/gpu_check.py --fp32-master --preset 1b --repeats 3
