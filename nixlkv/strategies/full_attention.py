"""GQA / MHA attention: each rank holds a contiguous slice of KV heads; K and V share a page.

A local page is filled head run by head run (``core.topology.head_sources``): one segment per
run, read from the remote rank that holds those heads, at that rank's head offset. This is a
direct byte copy only where a head run is one contiguous run of bytes on both sides (heads
outermost in the page: LBHNC / BLHNC, or the whole page at equal TP in any layout).

Subclasses served through the MRO on purpose: ``RSWASpec`` (it evicts gap blocks only during
decode, so at the P->D hand-off every prompt block is held, as in full attention; a null block
in a request is refused, never moved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import AttentionSpec

from ..core import (
    HeadRun,
    IncompatibleGeometry,
    MalformedRemoteFact,
    OwnedTail,
    PageLayout,
    LayerCache,
    Region,
    Segment,
    Strategy,
    Topology,
    box_copy_runs,
    check_owned,
    head_sources,
    heads_held,
)
from ..core.token_blocks import pair_by_tokens, token_phases

# Facts both sides must agree on, with what a mismatch means for the operator.
MATCHING_FACTS = {
    "total_kv_heads": "the model's KV head count",
    "head_size": "head size",
    "head_size_v": "V head size",
    "dtype": "KV-cache dtype",
    "kv_quant_mode": "KV-cache quantisation",
    "content_bytes": "bytes per head and token",
}


class FullAttentionStrategy(Strategy):
    name = "full_attention"
    spec_types = (AttentionSpec,)
    segments_by_geometry = True  # segments read pages and facts only, never names or bases
    # Facts both sides must agree on; subclasses extend it with their own.
    matching_facts: ClassVar[Mapping[str, str]] = MATCHING_FACTS

    def extra_facts(self, spec: AttentionSpec) -> dict[str, object]:
        """Facts a subclass adds to the region (e.g. a window); none for plain attention."""
        return {}

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        spec = layer.spec
        if getattr(spec, "block_table_token_alignment", 0) is None:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: a {type(spec).__name__}'s blocks are not token blocks (vLLM gives it no "
                "block-table token alignment), and full attention pairs blocks by token range; the strategy for "
                "it is missing or disabled (see `nixlkv strategies`)"
            )
        total = layer.hints.get("total_kv_heads")
        if not isinstance(total, int) or total < 1:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: the engine must give total_kv_heads (the model's KV head "
                "count for this layer); a per-rank spec cannot tell it when heads are replicated"
            )
        held = heads_held(topology.tp_rank, topology.tp_size, total)
        if spec.num_heads != len(held) or spec.num_kv_heads != len(held):
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: spec holds {spec.num_kv_heads} KV heads ({spec.num_heads} slots) "
                f"but {total} heads over tp={topology.tp_size} give {len(held)} per rank"
            )
        page = layer.page
        kernel, _, _ = kernel_pages(page)
        tokens = page_tokens(page)
        for axis, size, want in (
            ("head", kernel.size("head"), len(held)),
            ("token", tokens, spec.num_states),
            ("byte", kernel.size("byte"), spec.state_content_size_bytes),
        ):
            if size != want:
                raise IncompatibleGeometry(f"layer {layer.name!r}: page holds {size} along {axis!r}, spec says {want}")
        return Region.of_layer(
            layer,
            self.name,
            {
                # which heads a rank holds follows from its rank and TP size (heads_held), so
                # every rank of an engine describes a layer alike: a peer parses it once
                "total_kv_heads": total,
                "num_heads": len(held),
                "head_size": spec.head_size,
                "head_size_v": spec.head_size_v,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "kv_quant_mode": int(spec.kv_quant_mode),
                "content_bytes": spec.state_content_size_bytes,
                "tokens_per_block": spec.block_size,
                # False where the backend's page interior is not token-major (see nixlkv.vllm.model_backend):
                # only whole-block copies are exact there
                "token_major_interior": bool(layer.hints.get("token_major_interior", True)),
                **({"interior": str(layer.hints["interior"])} if "interior" in layer.hints else {}),
                **self.extra_facts(spec),
            },
        )

    def segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        total = local.fact("total_kv_heads")
        remote = {rank: with_page_facts(peer, total, rank) for rank, peer in remote.items()}
        for peer in remote.values():
            check_matching_facts(local, peer, self.matching_facts)
        runs = head_sources(local_topology.tp_rank, local_topology.tp_size, remote_tp, total)
        out = []
        for run in runs:
            peer = remote[run.remote_rank]
            check_head_start(local, peer, run.remote_rank, remote_tp, total)
            phases = token_phases(tokens_per_block(local), tokens_per_block(peer))
            if len(phases) > 1 or kernel_pages(local.page)[1] != kernel_pages(peer.page)[1]:
                refuse_token_split(local, peer)
            for phase, (local_token, remote_token, tokens) in enumerate(phases):
                for loff, roff, nbytes in head_token_runs(local, peer, run, local_token, remote_token, tokens):
                    out.append(Segment(local.name, loff, run.remote_rank, peer.name, roff, nbytes, phase))
        return out

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        return pair_owned_blocks(local_ids, remote_ids, local, remote, num_tokens, "full-attention")

    def block_pairing(self, local: Region, remote: Region) -> OwnedTail | None:
        return owned_tail(local, remote, "full-attention")


def pair_owned_blocks(
    local_ids: np.ndarray, remote_ids: np.ndarray, local: Region, remote: Region, num_tokens: int | None, kind: str
) -> tuple[np.ndarray, ...]:
    """Token blocks a request owns outright (no window, no state): paired by token range from the
    tail, null block refused.

    Shared by every strategy whose request keeps all its blocks, so regions of different kinds in
    one KV group (GQA + MLA draft) pair the group's block IDs the same way.
    """
    check_owned(local_ids, remote_ids, kind)
    return pair_by_tokens(local_ids, remote_ids, tokens_per_block(local), tokens_per_block(remote), num_tokens)


def owned_tail(local: Region, remote: Region, kind: str) -> OwnedTail | None:
    """What :func:`pair_owned_blocks` does where both sides hold the same tokens per block, as a
    pairing the core applies itself; None where they differ (pairs by token range, with phases)."""
    return OwnedTail(kind) if tokens_per_block(local) == tokens_per_block(remote) else None


def refuse_token_split(local: Region, peer: Region) -> None:
    """A copy of part of a block's tokens is exact only where both pages say where each token's
    bytes are: token-major inside, or page parts describing the backend's real order."""
    for side, region in (("local", local), ("remote", peer)):
        if region.facts.get("token_major_interior", True) is False and not region.page.parts:
            raise IncompatibleGeometry(
                f"layer {local.name!r}: P and D hold {tokens_per_block(peer)} and {tokens_per_block(local)} tokens "
                f"per block, which copies part of a block's tokens, but the {side} page is not token-major inside "
                f"({region.facts.get('interior', 'its backend says so')}); start P and D with the same --block-size"
            )


def tokens_per_block(region: Region) -> int:
    """Tokens a block of the region holds: advertised, or read off its page."""
    if "tokens_per_block" in region.facts:
        return int(region.facts["tokens_per_block"])
    return page_tokens(region.page)


def page_tokens(page: PageLayout) -> int:
    """Tokens one block's page holds: its kernel pages' tokens times how many make a block."""
    return kernel_pages(page)[1] * (page.size("kblock") if page.names[0] == "kblock" else 1)


def with_page_facts(peer: Region, total_kv_heads: int, rank: int) -> Region:
    """A remote region with the facts its page and topology imply filled in where it did not
    advertise them (a minimal, homogeneous peer): tokens per block, heads per rank, content bytes.
    What it did advertise is kept, and then checked like any other fact."""
    kernel, _, _ = kernel_pages(peer.page)
    derived = {
        "total_kv_heads": total_kv_heads,
        "num_heads": kernel.size("head"),
        "content_bytes": kernel.size("byte"),
        "tokens_per_block": page_tokens(peer.page),
    }
    # What the page itself says cannot be advertised otherwise: a remote claiming other tokens,
    # heads or bytes per block than its page holds would be paired on a fiction.
    for key in ("num_heads", "content_bytes", "tokens_per_block"):
        if key in peer.facts and peer.facts[key] != derived[key]:
            raise MalformedRemoteFact(
                f"layer {peer.name!r}: remote rank {rank} advertises {key}={peer.facts[key]!r}, but its page "
                f"{peer.page.describe()} holds {derived[key]}"
            )
    if all(k in peer.facts for k in derived):
        return peer
    return dataclasses.replace(peer, facts={**derived, **peer.facts})


def check_head_start(local: Region, peer: Region, rank: int, tp: int, total_kv_heads: int) -> None:
    """A peer's first head is where its rank puts it (:func:`heads_held`): no rank advertises it,
    but a peer that does (an older nixlkv) must advertise that."""
    advertised = peer.facts.get("head_start")
    if advertised is None:
        return
    expected = heads_held(rank, tp, total_kv_heads).start
    if advertised != expected:
        raise IncompatibleGeometry(
            f"layer {local.name!r}: remote rank {rank} advertises head_start={advertised!r}, but "
            f"{total_kv_heads} heads over tp={tp} put it at {expected}"
        )


def kernel_pages(page: PageLayout) -> tuple[PageLayout, int, int]:
    """(kernel page layout, tokens per kernel page, bytes per kernel page) of a block's page.

    A logical block split into kernel blocks is ``kblock`` consecutive kernel pages."""
    if page.names[0] != "kblock":
        return page, page.size("token"), page.nbytes
    inner = page.inner("kblock")
    return inner, inner.size("token"), inner.nbytes


def head_token_runs(
    local: Region, peer: Region, run: HeadRun, local_token: int, remote_token: int, tokens: int
) -> list[tuple[int, int, int]]:
    """Byte runs copying ``run``'s heads for ``tokens`` tokens from ``remote_token`` of the remote
    page to ``local_token`` of the local page, split where either side's kernel pages end.

    A direct copy needs a fixed number of runs per head (heads outermost in the page, or whole
    pages); runs per token are a permute and are refused."""
    lpage, ltok, lbytes = kernel_pages(local.page)
    rpage, rtok, rbytes = kernel_pages(peer.page)
    out: list[tuple[int, int, int]] = []
    done = 0
    while done < tokens:
        lk, lin = divmod(local_token + done, ltok)
        rk, rin = divmod(remote_token + done, rtok)
        n = min(ltok - lin, rtok - rin, tokens - done)
        try:
            runs = _head_box(lpage, rpage, run, lin, rin, n)
            # A head slice costs a fixed number of runs (one per head on a head-outer page, one
            # per head and channel where keys are channel-major); runs that grow with the tokens
            # copied mean tokens are outer to heads: that copy is a permute, refused (a single run,
            # the whole slice contiguous, has not grown: no second box to compare it with).
            if n > 1 and len(runs) > 1 and len(runs) > len(_head_box(lpage, rpage, run, lin, rin, 1)):
                raise IncompatibleGeometry("a head slice is one run per token")
        except IncompatibleGeometry as exc:
            raise IncompatibleGeometry(f"layer {local.name!r}: {layout_advice(local, peer)} ({exc})") from None
        out.extend((lk * lbytes + a, rk * rbytes + b, c) for a, b, c in runs)
        done += n
    return out


def _head_box(lpage: PageLayout, rpage: PageLayout, run: HeadRun, lin: int, rin: int, n: int) -> list[tuple[int, int, int]]:
    return box_copy_runs(
        lpage, {"head": run.local_slot, "token": lin}, rpage, {"head": run.remote_slot, "token": rin},
        {"head": run.count, "token": n},
    )


def check_matching_facts(local: Region, peer: Region, facts: Mapping[str, str]) -> None:
    """Both sides must describe the same cache: name the first fact that differs, with both values.

    A fact the peer does not advertise is not compared (its page geometry still is)."""
    for key, meaning in facts.items():
        if key not in peer.facts:
            continue
        mine, theirs = local.fact(key), peer.fact(key)
        if mine != theirs:
            raise IncompatibleGeometry(
                f"layer {local.name!r}: {meaning} ({key}) is {mine!r} here but {theirs!r} on the remote "
                "engine; both engines must use the same value"
            )


def layout_advice(local: Region, peer: Region) -> str:
    return (
        f"a head slice is not one contiguous byte run (local page {local.page.describe()}, remote page "
        f"{peer.page.describe()}); heterogeneous TP needs heads outermost in the page on both sides "
        "(KV-cache layout LBHNC or BLHNC), or the same layout and the same TP on both sides"
    )
