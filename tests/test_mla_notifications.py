"""MLA frees prefill blocks by notification: who is read, who is only told, and with which id.

A prefill rank frees a request's blocks after ``consumers`` nixlkv notifications carrying the
*prefill-side* request id (vLLM once sent the decode-side id, and P ranks never freed). These
tests read what every prefill rank actually received through NIXL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.testing import rehearsal
from nixlkv.testing.rehearsal import REQUEST_ID, rehearse
from nixlkv.testing.scenario import load
from nixlkv.transport.nixl_rank import NixlRank

pytestmark = pytest.mark.nixl

SCENARIOS = Path(__file__).parent / "scenarios"


def test_p8_d2_one_read_per_decode_rank_and_three_notify_only() -> None:
    result = rehearse(load(SCENARIOS / "mla-p8-d2-bf16.yaml"))
    assert result.outcome == "byte-exact", result.message
    # D0 reads P0, D1 reads P4 (r * P_TP / D_TP); the other covered ranks are only told.
    assert [p["read_ranks"] for p in result.plans] == [[0], [4]]
    assert [p["covered_remote_ranks"] for p in result.plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert result.reads == 2
    # Every prefill rank holds the request and hears exactly once, with the remote id and count 1.
    assert result.notification_log == {f"P{r}": [(REQUEST_ID, 1)] for r in range(8)}
    assert result.notifications == {f"P{r}": 1 for r in range(8)}


def test_p2_d8_four_readers_per_prefill_rank() -> None:
    result = rehearse(load(SCENARIOS / "mla-p2-d8-bf16.yaml"))
    assert result.outcome == "byte-exact", result.message
    assert [p["read_ranks"] for p in result.plans] == [[r // 4] for r in range(8)]
    assert result.reads == 8
    # Each prefill rank is read by four decode ranks; it must wait for all four before freeing.
    assert result.notification_log == {f"P{r}": [(REQUEST_ID, 4)] * 4 for r in range(2)}


def test_a_decode_side_request_id_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of vllm#41974: notifications carrying the wrong request id leave P blocks held."""
    post = NixlRank.post

    def wrong_id(self, prepared, resolved, remote_request_id):  # type: ignore[no-untyped-def]
        return post(self, prepared, resolved, "decode-side-req-0")

    monkeypatch.setattr(NixlRank, "post", wrong_id)
    monkeypatch.setattr(rehearsal, "NOTIFICATION_TIMEOUT", 2.0)
    result = rehearse(load(SCENARIOS / "mla-p8-d2-fp8.yaml"))
    assert result.outcome == "failed"
    assert "request id 'decode-side-req-0'" in result.message
    assert all(n == 0 for n in result.notifications.values())


def test_missing_notify_only_messages_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping the notify-only messages leaves P1-P3 and P5-P7 holding the request forever."""
    import dataclasses

    monkeypatch.setattr(rehearsal, "NOTIFICATION_TIMEOUT", 2.0)
    result = rehearse(
        load(SCENARIOS / "mla-p8-d2-fp8.yaml"),
        fault=lambda rank, resolved: dataclasses.replace(resolved, notify_only=()),
    )
    assert result.outcome == "failed"  # the bytes are right; the freeing is not
    assert result.notifications == {f"P{r}": int(r in (0, 4)) for r in range(8)}
    assert "P1: 0 notifications, expected 1" in result.message
