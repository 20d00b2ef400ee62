#!/usr/bin/env bash
# One prepared command for a lent CUDA GPU (see benchmarks/gpu_check.py): staged vs lazy export of a
# Qwen2.5-7B-shaped model with offloaded shards, the pinned-copy floor, time to the first tensor and
# peak GPU memory. Uses the machine's own torch/transformers (no install, no network); the whole
# run is bounded to 7 minutes so it fits an 8-minute budget with the machine's start. Table last.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
timeout 420 python benchmarks/gpu_check.py "$@"
