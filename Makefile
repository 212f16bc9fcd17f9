# One-command set-up for a CPU-only machine. On a GPU machine: pip install -e .[vllm,test]
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nixlkv-installed

.PHONY: venv test rehearse compare bench bench-quick bench-pytest lock clean

venv: $(STAMP)

# torch 2.13.0 (CPU) must come first: a plain torch requirement would pull GBs of CUDA wheels.
# vLLM 0.33.0 pins torch 2.14.0 and GPU-only packages, so it goes in with --no-deps on top of the
# exact set of packages its CPU-importable modules need (requirements/cpu-lock.txt).
$(STAMP): pyproject.toml requirements/cpu-lock.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c requirements/cpu-lock.txt nixl==1.5.1 -r requirements/cpu-lock.txt
	$(BIN)/python -m pip install -q --no-deps vllm==0.33.0
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip install -q --no-deps -e examples/nixlkv-example-plugin
	$(BIN)/python -c "import nixlkv, nixl._api, vllm.v1.kv_cache_interface" 
	touch $(STAMP)

# pyproject's testpaths: tests/ and examples/nixlkv-example-plugin/tests (the example plugin's own
# tests, which run nixlkv's contract suite through the auto-registered pytest plugin).
test: venv
	$(BIN)/python -m pytest -q

rehearse: venv
	$(BIN)/nixlkv rehearse

# nixlkv against vLLM 0.33's own NixlConnector over every scenario (slow: ~15 s per scenario on
# 2 cores). Regenerates the table in docs/comparison.md (see there); CI runs a smoke subset only.
compare: venv
	$(BIN)/nixlkv compare --scenarios tests/scenarios --markdown docs/comparison-table.md --json-out docs/comparison.json

# nixlkv against vLLM 0.33's own planner (docs/performance.md). Timings: ratios within one run.
bench-quick: venv
	$(BIN)/nixlkv bench --quick --json

bench: venv
	$(BIN)/nixlkv bench --markdown docs/performance-tables.md --plot docs/performance.png

# pytest-benchmark suite; outside tests/ so `make test` never times anything
bench-pytest: venv
	$(BIN)/python -m pytest benchmarks

lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|vllm|nixl|nixl-cu12|nixl-cu13)==' > requirements/cpu-lock.txt

clean:
	rm -rf $(VENV)
