"""Deliberately wrong strategies shared by the fault tests and the contract-kit tests.

Each gets a fault that plan validation or the byte oracle must catch; keep them wrong on purpose.
"""

import dataclasses

from nixlkv.strategies.full_attention import FullAttentionStrategy


class OffByOneHead(FullAttentionStrategy):
    """Reads every head run one head slot too far into the remote page (P1 -> D2: rank 0 gets head 1)."""

    name = "off_by_one_head"
    overrides = ("full_attention",)

    def segments(self, local, remote, local_topology, remote_tp):
        out = []
        for s in super().segments(local, remote, local_topology, remote_tp):
            page = remote[s.remote_rank].page
            head_bytes = page.nbytes // page.size("head")
            shifted = s.remote_offset + head_bytes
            out.append(dataclasses.replace(s, remote_offset=shifted if shifted + s.nbytes <= page.nbytes else s.remote_offset - head_bytes))
        return out


class OverlappingSegments(FullAttentionStrategy):
    """Lists the first segment twice: two writes of the same local bytes."""

    name = "overlapping_segments"
    overrides = ("full_attention",)

    def segments(self, local, remote, local_topology, remote_tp):
        segs = super().segments(local, remote, local_topology, remote_tp)
        return [segs[0], *segs]
