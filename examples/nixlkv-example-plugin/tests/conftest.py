"""vLLM reads these before its first import: offline, CPU-only planning, quiet logs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
