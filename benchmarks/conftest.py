"""pytest-benchmark suite, deliberately outside ``tests/`` so ``make test`` never times anything.

Run it with ``make bench-pytest`` (or ``.venv/bin/python -m pytest benchmarks``).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
