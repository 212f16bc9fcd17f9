"""The contract kit must catch wrong strategies, and say which invariant they broke.

Each strategy here is deliberately wrong in one way a real one has been (see
/docs/contract.md): the kit must fail it with a message naming the invariant, not merely fail.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import hookimpl
from nixlkv.strategies.full_attention import FullAttentionStrategy
from nixlkv.testing import contract
from nixlkv.testing.cases import BUILTIN_CASES
from nixlkv.testing.contract import ContractCase, ContractViolation, Point

from faulty_strategies import OffByOneHead, OverlappingSegments

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[1]


class TrimsLastBlock(FullAttentionStrategy):
    """Drops the request's last block, as the Mamba state was trimmed (seed: state block lost)."""

    name = "trims_last_block"
    overrides = ("full_attention",)

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        lp, rp, phase = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
        return lp[:-1], rp[:-1], phase[:-1]


class AssertsOnHeteroTP(FullAttentionStrategy):
    """Asserts where it should refuse (seed: asserts crashing the worker)."""

    name = "asserts_on_hetero_tp"
    overrides = ("full_attention",)

    def segments(self, local, remote, local_topology, remote_tp):
        assert remote_tp == local_topology.tp_size, "hetero TP not supported"
        return super().segments(local, remote, local_topology, remote_tp)


class TorchDtypeFact(FullAttentionStrategy):
    """Advertises a fact that does not survive the handshake (a tuple, not a list)."""

    name = "tuple_fact"
    overrides = ("full_attention",)

    def local_region(self, layer, topology):
        region = super().local_region(layer, topology)
        return dataclasses.replace(region, facts={**region.facts, "shape": (1, 2)})


class WritesStrayBlock(FullAttentionStrategy):
    """Pairs the last local block with block 1 past it: a write outside the request."""

    name = "writes_stray_block"
    overrides = ("full_attention",)

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        lp, rp, phase = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
        lp = lp.copy()
        lp[-1] = int(local_ids.max()) + 1 if int(local_ids.max()) + 1 < local.num_blocks else 1
        return lp, rp, phase


class SplitsByBlockCount(FullAttentionStrategy):
    """Right bytes, but an answer that depends on the peers' block count (each segment split in
    two where their blocks sum to an odd number), while it says segments_by_geometry."""

    name = "splits_by_block_count"
    overrides = ("full_attention",)

    def segments(self, local, remote, local_topology, remote_tp):
        segs = super().segments(local, remote, local_topology, remote_tp)
        if sum(peer.num_blocks for peer in remote.values()) % 2 == 0:
            return segs
        out = []
        for s in segs:
            half = s.nbytes // 2
            out += [dataclasses.replace(s, nbytes=half),
                    dataclasses.replace(s, local_offset=s.local_offset + half, remote_offset=s.remote_offset + half, nbytes=s.nbytes - half)]
        return out


def case_for(strategy) -> ContractCase:
    class Plugin:
        @hookimpl
        def nixlkv_strategies(self):
            return [strategy]

    return dataclasses.replace(BUILTIN_CASES["full_attention"], strategy=strategy.name, plugins=(Plugin(),))


def violation(strategy, point: Point) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        contract.check_point(case_for(strategy), point)
    return info.value


P1_D2 = Point(1, 2)
P4_D2 = Point(4, 2)


def test_the_reference_strategy_passes_at_the_same_points() -> None:
    """The faults below are the only difference: the unmodified strategy passes these points."""
    for point in (P1_D2, P4_D2):
        contract.check_point(BUILTIN_CASES["full_attention"], point)


def test_off_by_one_head_slot_fails_the_byte_oracle() -> None:
    v = violation(OffByOneHead(), P1_D2)
    assert v.invariant == contract.BYTE_ORACLE
    assert str(v).startswith("contract: byte-oracle violated: P1-D2-")
    assert "global head" in str(v)


def test_overlapping_segments_fail_no_overlapping_writes() -> None:
    v = violation(OverlappingSegments(), P4_D2)
    assert v.invariant == contract.NO_OVERLAP
    assert "contract: no-overlapping-writes violated" in str(v) and "written twice" in str(v)


def test_trimming_the_last_block_fails_every_byte_once() -> None:
    v = violation(TrimsLastBlock(), P4_D2)
    assert v.invariant == contract.EVERY_BYTE_ONCE
    assert "contract: every-byte-once violated" in str(v) and "never written" in str(v)
    # The last block position of a 100-token request in 16-token blocks is 6.
    assert "request block position 6" in str(v)


def test_an_assert_instead_of_a_refusal_fails_documented_errors() -> None:
    v = violation(AssertsOnHeteroTP(), P4_D2)
    assert v.invariant == contract.DOCUMENTED_ERRORS
    assert "AssertionError" in str(v) and "never assert" in str(v)


def test_a_fact_that_changes_over_the_wire_fails_serialisable() -> None:
    v = violation(TorchDtypeFact(), P1_D2)
    assert v.invariant == contract.SERIALISABLE and "changes over the wire" in str(v)


def test_a_write_outside_the_request_fails_every_byte_once() -> None:
    v = violation(WritesStrayBlock(), P1_D2)
    assert v.invariant == contract.EVERY_BYTE_ONCE
    assert "not one of the request's blocks" in str(v) or "written 2 times" in str(v)


def test_a_coverage_exemption_needs_a_known_name_and_a_reason() -> None:
    class Exempt(TrimsLastBlock):
        name = "exempt_trim"
        contract_exempt = {"full-coverage": "test: the last block is recomputed by the decode engine"}

    contract.check_point(case_for(Exempt()), P4_D2)  # exempt from completeness only...

    class BadExempt(FullAttentionStrategy):
        name = "bad_exempt"
        overrides = ("full_attention",)
        contract_exempt = {"no-overlapping-writes": "trust me"}

    with pytest.raises(ContractViolation, match="only \\['full-coverage'\\] may be exempted"):
        contract.check_dispatch(case_for(BadExempt()))


def test_a_case_whose_strategy_does_not_serve_the_kind_fails_dispatch() -> None:
    case = dataclasses.replace(BUILTIN_CASES["full_attention"], strategy="sliding_window")
    with pytest.raises(ContractViolation, match="contract: dispatch violated: .* served by 'full_attention', not 'sliding_window'"):
        contract.check_dispatch(case)


def test_a_refusal_the_case_documents_must_happen() -> None:
    case = dataclasses.replace(BUILTIN_CASES["full_attention"], refuses=lambda point, params: "IncompatibleTopology")
    with pytest.raises(ContractViolation, match="documented-errors violated: .*planning succeeded"):
        contract.check_refusal(contract.build_point(case, P1_D2))


def test_default_matrix_covers_both_directions_replication_and_two_layouts() -> None:
    for case in BUILTIN_CASES.values():
        served = [p for p in case.points(full=False) if case.refusal(p) is None]
        pairs = {(p.prefill_tp, p.decode_tp) for p in served}
        heads = case.params.get("num_kv_heads", 1)  # a replicated latent (MLA) is one head
        assert any(p < d for p, d in pairs) and any(p > d for p, d in pairs) and any(p == d for p, d in pairs)
        assert any(max(p, d) > heads for p, d in pairs), "replication (TP above the head count)"
        if case.refuses_longer_local_list:  # token caches; a state cache has no tokens or page layout axis
            assert {p.prefill_layout for p in served} >= {"LBHNC", "BLHNC"}
            assert any(p.cached_blocks for p in served) and len({p.num_tokens for p in served}) >= 2
        assert any(case.refusal(p) for p in case.points(full=False)), "refusal probes"
        assert len(case.points(full=True)) > 5 * len(case.points(full=False))


def test_pytest_plugin_reports_the_broken_invariant(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite as a plugin author runs it: `pytest -p nixlkv.testing` in a fresh process.

    With nixlkv installed, the pytest11 entry point registers the same plugin name, so this
    also proves `-p` plus auto-registration does not register it twice.
    """
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(
        test_mine=textwrap.dedent(
            """
            import dataclasses
            from nixlkv.core import hookimpl
            from nixlkv.strategies.full_attention import FullAttentionStrategy
            from nixlkv.testing.cases import BUILTIN_CASES
            from nixlkv.testing.suite import StrategyContract

            class TrimsLastBlock(FullAttentionStrategy):
                name = "trims_last_block"
                overrides = ("full_attention",)

                def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
                    lp, rp, phase = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
                    return lp[:-1], rp[:-1], phase[:-1]

            class Plugin:
                @hookimpl
                def nixlkv_strategies(self):
                    return [TrimsLastBlock()]

            class TestTrimsContract(StrategyContract):
                case = dataclasses.replace(
                    BUILTIN_CASES["full_attention"], strategy="trims_last_block", plugins=(Plugin(),),
                    tp_pairs=((4, 2),), layouts=("LBHNC",), block_sizes=(16,), token_counts=(100,), prefix_hits=(0,),
                    extra_points=(),
                )
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "nixlkv.testing", "-q", "-p", "no:cacheprovider", "-k", "(every_byte_once or byte_oracle) and LBHNC or dispatch")
    result.stdout.fnmatch_lines(["*contract: every-byte-once violated: P4-D2-LBHNC-bs16-t100*never written*"])
    result.stdout.fnmatch_lines(["*contract: byte-oracle violated: P4-D2-LBHNC-bs16-t100*"])
    # the default matrix's CPU-interior point (keys channel-major, P and D at 16/32 tokens) catches it too
    result.stdout.fnmatch_lines(["*contract: byte-oracle violated: P4-D2-LBHNC-bs16-32-t100-k_channel_major*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 4 and outcomes.get("passed") == 1, outcomes
    assert "already registered" not in result.stdout.str() + result.stderr.str()


def _attention_kind(coordinates):
    from nixlkv.testing.kinds import KINDS, KindDef

    builtin = KINDS["full_attention"]
    return KindDef(builtin.required, builtin.optional, builtin.build, coordinates=coordinates)


def test_an_element_coordinate_function_drives_both_fill_and_expectation() -> None:
    """A kind's coordinates replace the attention default on both sides: attention physics
    written as a coordinate function passes; a wrong physics (every rank's slot h is "head h",
    as if heads were not sharded) makes the same correct strategy fail the byte oracle."""
    from nixlkv.testing.oracle import attention_coordinates

    right = dataclasses.replace(
        BUILTIN_CASES["full_attention"], kind="contract_test_attention_coords", kind_def=_attention_kind(attention_coordinates)
    )
    contract.check_point(right, P1_D2)

    def unsharded(q):
        coords = attention_coordinates(q)
        return {**coords, "head": np.arange(q.shape[0])[None, :, None, None]}

    wrong = dataclasses.replace(
        BUILTIN_CASES["full_attention"], kind="contract_test_unsharded_coords", kind_def=_attention_kind(unsharded)
    )
    with pytest.raises(ContractViolation, match="contract: byte-oracle violated: P1-D2-.*decode rank 1"):
        contract.check_point(wrong, P1_D2)


def test_a_kind_name_cannot_be_taken_over_by_another_definition() -> None:
    from nixlkv.testing.kinds import KINDS, register_kind

    register_kind("full_attention", KINDS["full_attention"])  # the same definition: a no-op
    with pytest.raises(ValueError, match="already registered with another definition"):
        register_kind("full_attention", _attention_kind(None).__class__(("num_kv_heads",), {}, KINDS["sliding_window"].build))


def test_pytest11_entry_point_names_the_plugin_module_itself() -> None:
    """Auto-registration and `-p nixlkv.testing` must use one plugin name, or pytest refuses to
    register the module twice ("Plugin already registered under a different name")."""
    import re

    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.entry-points\.pytest11\]\n(.*?)(?=^\[)", text, re.MULTILINE | re.DOTALL)
    assert section is not None, "pyproject.toml lacks [project.entry-points.pytest11]"
    entries = dict(re.findall(r'^"?([\w.]+)"?\s*=\s*"([\w.]+)"', section.group(1), re.MULTILINE))
    assert entries == {"nixlkv.testing": "nixlkv.testing"}


def test_the_auto_loaded_plugin_imports_nothing_heavy() -> None:
    """pytest loads the plugin in every run wherever nixlkv is installed: no vLLM, torch or NIXL."""
    import subprocess
    import sys

    code = "import sys, nixlkv.testing; print(sorted(m for m in ('torch', 'vllm', 'nixl', 'pytest') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class DeclaresButReverses(FullAttentionStrategy):
    """Declares the owned-tail pairing for the core but pairs its blocks in reverse itself: the
    plan (paired by the core) moves the right bytes, so only the comparison of the two answers
    can see that the declaration is not the strategy's own pairing."""

    name = "declares_but_reverses"
    overrides = ("full_attention",)

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        lp, rp, *_ = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
        return lp, rp[::-1].copy()

    def block_pairing(self, local, remote):
        return super().block_pairing(local, remote)


def test_a_declared_pairing_unlike_pair_blocks_fails_deterministic() -> None:
    v = violation(DeclaresButReverses(), P4_D2)
    assert v.invariant == contract.DETERMINISTIC
    assert "block_pairing declares" in str(v) and "pairs otherwise than pair_blocks" in str(v)


def test_segments_that_depend_on_the_block_count_fail_deterministic() -> None:
    v = violation(SplitsByBlockCount(), P1_D2)
    assert v.invariant == contract.DETERMINISTIC
    assert "3 more blocks" in str(v) and "segments_by_geometry" in str(v)
    # the same strategy declared as asked per layer keeps its promise
    honest = SplitsByBlockCount()
    honest.segments_by_geometry = False
    contract.check_point(case_for(honest), P1_D2)
