"""The vLLM connector's parts: configuration, handshake wire format and side channel, worker, scheduler.

``nixlkv.connector.NixlkvConnector`` is the facade vLLM loads; these modules hold the logic so
each can be tested on its own (the worker from a small engine description, the scheduler with
vLLM's real v1 Scheduler).
"""
