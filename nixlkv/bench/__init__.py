"""``nixlkv bench``: nixlkv against vLLM 0.33's own NIXL planner, on the same inputs, in one run.

Planning is measured over fabricated geometry (integers only, no KV memory), so Llama-70B-like
shapes at 128k tokens cost nothing to set up; real transfers move real bytes through NIXL over
DRAM next to a same-run single-thread memcpy. Every comparison is a ratio taken within one run
from interleaved repetitions: this project's machines are small and shared, so absolute times
from different runs are not comparable, ratios from one run are.
"""
