"""Shared fixtures. vLLM reads these before its first import; set them once for the session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# The contract suite's plugin. When nixlkv is installed its pytest11 entry point has already
# registered it under this same name, and pytest then skips this line: never registered twice.
pytest_plugins = ["nixlkv.testing", "pytester"]
