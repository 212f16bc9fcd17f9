"""Dogfooding: every built-in strategy runs the same contract suite third-party plugins run.

No private shortcuts: these classes are exactly what a plugin author writes (a case, nothing
else); the matrix, the invariants and the byte oracle come from nixlkv.testing.
"""

from __future__ import annotations

import pytest

from nixlkv.testing.cases import BUILTIN_CASES
from nixlkv.testing.contract import check_pending_refuses
from nixlkv.testing.suite import StrategyContract

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


class TestFullAttentionContract(StrategyContract):
    case = BUILTIN_CASES["full_attention"]


class TestSlidingWindowContract(StrategyContract):
    case = BUILTIN_CASES["sliding_window"]


class TestMLAContract(StrategyContract):
    case = BUILTIN_CASES["mla"]


class TestSlidingWindowMLAContract(StrategyContract):
    case = BUILTIN_CASES["sliding_window_mla"]


class TestMambaContract(StrategyContract):
    case = BUILTIN_CASES["mamba"]


def test_every_builtin_case_runs_as_a_contract_class() -> None:
    """A case without a class here would never run: each BUILTIN_CASES entry has one."""
    classes = [v for v in globals().values() if isinstance(v, type) and issubclass(v, StrategyContract) and v is not StrategyContract]
    assert sorted(c.case.strategy for c in classes) == sorted(BUILTIN_CASES)


def _pending():
    from nixlkv.strategies.pending import PENDING

    return PENDING


def test_every_builtin_strategy_has_a_contract_case() -> None:
    """A new built-in strategy without a case (or a placeholder) fails here, by name."""
    from nixlkv.core import StrategyRegistry
    from nixlkv.core.registry import plugin_manager

    builtin = {r.strategy.name for r in StrategyRegistry.from_plugins(plugin_manager(load_entry_points=False)).registered()}
    pending = {s.name for s in _pending()}
    assert builtin - pending == set(BUILTIN_CASES), (builtin - pending) ^ set(BUILTIN_CASES)


@pytest.mark.parametrize("strategy", _pending(), ids=lambda s: s.name)
def test_pending_placeholders_refuse_cleanly(strategy) -> None:
    """Placeholders are not run through the matrix; they must refuse at the first question."""
    check_pending_refuses(strategy, spec=object())
