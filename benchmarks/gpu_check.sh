#!/usr/bin/env bash
# One prepared command for a lent CUDA GPU: staged vs lazy export of a ~1B-parameter model with
# offload="params". Uses the machine's own torch/transformers (no install); prints a table last.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 420 python benchmarks/gpu_check.py "$@"
