"""Test tooling for nixlkv and its plugins: scenarios, fabricated engines, the byte oracle, the
rehearsal, and the strategy contract kit (:mod:`.contract`, :mod:`.suite`).

This package is also nixlkv's pytest plugin. Installed nixlkv registers it through the
``pytest11`` entry point named ``nixlkv.testing``; from a source tree, ``pytest -p nixlkv.testing``.
Both use the same plugin name, so it is never registered twice. The hooks live in
:mod:`._pytest_plugin`, which imports nothing heavy; importing this package outside pytest costs
nothing.
"""

from ._pytest_plugin import pytest_addoption, pytest_configure, pytest_generate_tests

__all__ = ["pytest_addoption", "pytest_configure", "pytest_generate_tests"]
