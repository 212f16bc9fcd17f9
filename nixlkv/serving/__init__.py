"""Real serving: tiny local models, vLLM P and D servers, the P/D proxy and the serving check.

vLLM-specific (like ``nixlkv.vllm``): nothing in ``nixlkv.core`` imports it. See docs/serving.md.
"""
