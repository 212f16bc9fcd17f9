"""The contract suite as pytest tests: subclass :class:`StrategyContract`, set ``case``.

::

    from nixlkv.testing.contract import ContractCase
    from nixlkv.testing.suite import StrategyContract

    class TestMyStrategyContract(StrategyContract):
        case = ContractCase(strategy="my_strategy", kind="my_kind", params={...}, kind_def=MY_KIND)

The nixlkv pytest plugin (auto-registered through the ``pytest11`` entry point when nixlkv is
installed; ``pytest -p nixlkv.testing`` otherwise) parametrizes the per-point tests over the
case's matrix. Each test checks one invariant and fails with ``contract: <invariant> violated``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest

from . import contract
from .contract import ContractCase, Point, PointRun

PLUGIN_INACTIVE = (
    "the nixlkv pytest plugin is not active, so the contract matrix was not generated: install nixlkv "
    "(its pytest11 entry point registers the plugin) or run pytest with `-p nixlkv.testing`"
)


class StrategyContract:
    """Base class of a strategy's contract tests. Subclasses set ``case`` and nothing else."""

    __nixlkv_contract__: ClassVar[bool] = True
    case: ClassVar[ContractCase]

    @pytest.fixture(scope="class")
    @classmethod
    def contract_point(cls) -> Point:
        """Overridden by the plugin's parametrization; reached only when the plugin is absent."""
        pytest.fail(PLUGIN_INACTIVE, pytrace=False)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_run(cls, contract_point: Point) -> Iterator[PointRun]:
        """Both engines fabricated and planned once per point, shared by that point's checks."""
        yield contract.build_point(cls.case, contract_point)

    # ------------------------------------------------------------------ once per case
    def test_dispatch(self) -> None:
        contract.check_dispatch(self.case)

    def test_documented_errors_probe(self) -> None:
        contract.check_documented_errors_probe(self.case)

    # ------------------------------------------------------------------ refusal points
    def test_documented_refusal(self, contract_refusal_run: PointRun) -> None:
        contract.check_refusal(contract_refusal_run)

    # ------------------------------------------------------------------ every supported point
    def test_plans(self, contract_run: PointRun) -> None:
        contract.check_refusal(contract_run)

    def test_segments_inside_regions(self, contract_run: PointRun) -> None:
        contract.check_segments_inside_regions(contract_run)

    def test_no_overlapping_writes(self, contract_run: PointRun) -> None:
        contract.check_no_overlapping_writes(contract_run)

    def test_every_byte_once(self, contract_run: PointRun) -> None:
        contract.check_every_byte_once(contract_run)

    def test_reads_inside_request(self, contract_run: PointRun) -> None:
        contract.check_reads_inside_request(contract_run)

    def test_deterministic(self, contract_run: PointRun) -> None:
        contract.check_deterministic(contract_run)

    def test_serialisable(self, contract_run: PointRun) -> None:
        contract.check_serialisable(contract_run)

    def test_byte_oracle(self, contract_run: PointRun) -> None:
        contract.check_byte_oracle(contract_run)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_refusal_point(cls) -> Point:
        pytest.fail(PLUGIN_INACTIVE, pytrace=False)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_refusal_run(cls, contract_refusal_point: Point) -> PointRun:
        return contract.build_point(cls.case, contract_refusal_point)
