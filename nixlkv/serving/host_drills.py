"""``nixlkv serve-drill --hosts netns``: misconfiguration and network faults between P and D on
separate hosts (network namespaces, :mod:`nixlkv.serving.netns`), each judged as the loopback
drills are (:mod:`nixlkv.serving.drills`): by what the client sees, what D's log says, and the
engines' own KV usage.

9. **P advertises a loopback side channel**: P started with ``side_channel_host`` 127.0.0.1 (the
   setting left at loopback), a request prefilled on it and sent to D on its own host. D's
   handshake reaches only D's own loopback.
10. **P advertises a closed side-channel port**: a request whose ``kv_transfer_params`` name P's
    address and a port nothing listens on there (what D sees of a wrong ``side_channel_port``).
11. **P unreachable mid-request**: D has read from P before (handshaken, connected); a request
    prefilled on P, P's link dropped, the request sent to D; the link comes back
    :data:`UNREACHABLE_S` later, past D's transfer timeout.
12. **A link dropped for some seconds**: as 11, the link restored :data:`LINK_DOWN_S` after the
    request reached D, inside D's transfer timeout.

Each must give D's answer within its bound (the handshake timeout, or the link's outage past the
transfer timeout, and :data:`SLACK_S` for the engines' steps on this machine), the request recomputed exactly
(``recompute``) or failed (``fail``) unless it could still be read (12), D's log naming the
setting or the peer (nixlkv), D holding no blocks afterwards, and the next request to a reachable
P decoded exactly from P's KV (a transfer, bytes moved).

What "exactly" compares with (:func:`answer_reference`): a recomputed answer with D alone's, which
computes the prompt the same way; an answer D decoded from a load with the same prompt loaded from P
with no fault, not with D alone's. After a load D computes the last prompt token itself, in a
one-token step over the loaded KV, where D alone computes it inside the prompt's prefill: two
kernel calls that may round that token's logits one bf16 step apart. Measured (2026-11-28, tiny-llama
P1->D1, 2-core AMD EPYC VM, loaded): the drills' ninth seeded prompt, whose answer drill 12 judged,
answers with token 0's logprob 0.0459 from D alone's (-1.4278 vs -1.4737; the exact rule allows 0.02)
whenever it is loaded from P, the link dropped or not; D alone answers it identically each time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .bytecheck import judge_dir
from .check import Case, Options, Servers, default_rule, format_bytes, prefill_on, transfer_facts
from .client import Completion, CompletionError, complete, delta, scrape, settled_kv_usage
from .compare import Verdict, judge
from .drills import LEASE_S, LEASE_WAIT_S, Drill, random_prompt
from .launch import LOOPBACK

HANDSHAKE_TIMEOUT_S = 5.0  # D's handshake_timeout_s in these drills (nixlkv's default)
TRANSFER_TIMEOUT_S = 10.0  # D's transfer_timeout_s in these drills (default 30 s: shorter, for a quicker run)
SLACK_S = 20.0  # beyond a timeout: the engines' steps and D recomputing the prompt on this loaded machine
LINK_DOWN_S = 3.0  # drill 12: how long P's link is down once the request reached D
# drill 11: P's link down this long, past D's transfer timeout. D gives up on the READ at its
# timeout but reports the request only once NIXL says the READ ended, which over a stalled TCP
# connection is when the link is back (or TCP abandons the connection, minutes later): a READ
# released earlier would still land, into blocks vLLM has freed by then
UNREACHABLE_S = TRANSFER_TIMEOUT_S + 10.0
CLOSED_PORT_OFFSET = 7  # drill 10: P's side-channel port plus this, where nothing listens


def named_in_log(log: Path, since: int, *needles: str) -> bool:
    """Whether D's log, from byte ``since`` on, has a line holding every one of ``needles``."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(all(n in line for n in needles) for line in text.splitlines())


def judge_outcome(policy: str, answered: bool, exact: bool, loaded: bool, elapsed_s: float, bound_s: float,
                  named: bool | None, held: float, readable: bool = False) -> list[str]:
    """What went wrong with one faulted request, as the drills require it: answered exactly
    (``recompute``) or failed (``fail``), unless the KV could still be read (``readable``: the
    link came back within the timeout) and was; within ``bound_s``; the cause named in D's log
    (None: not checked, vLLM's connector); no blocks held on D afterwards."""
    faults = []
    if answered and not exact:
        faults.append("D answered from its load, but not as the same prompt loaded with no fault" if loaded
                      else "D answered, but not as D alone")
    elif answered and loaded and not readable:
        faults.append("D answered from a load it could not have made (the fault did not bite)")
    elif answered and policy == "fail" and not loaded:
        faults.append("answered under fail without a load: D recomputed what it should have failed")
    elif not answered and policy == "recompute":
        faults.append("failed under recompute")
    if elapsed_s > bound_s:
        faults.append(f"D took {elapsed_s:.1f} s, past its bound of {bound_s:.0f} s")
    if named is False:
        faults.append("D's log does not name the setting or the peer")
    if held > 0:
        faults.append(f"D still holds KV ({held:.4f})")
    return faults


@dataclass(frozen=True)
class Judged:
    """A faulted request's answer against its reference (:func:`answer_reference`)."""

    verdict: Verdict
    reference: str  # what the answer was compared with
    d_alone: Verdict  # against D alone's answer, whatever the reference (a fact for the reader)


def answer_reference(got: Completion, d_alone: Completion, unfaulted: Completion | None) -> Judged:
    """Judge ``got`` by the exact rule against what it must equal: ``unfaulted`` (the same prompt
    loaded from P with no fault) where D answered from a load, else ``d_alone``. A loaded answer
    against D alone's would fail wherever D's one-token step for the last prompt token rounds its
    logits apart from D alone's prefill (module docstring), though nothing went wrong."""
    alone = judge(d_alone, got, "exact")
    if unfaulted is None:
        return Judged(alone, "D alone", alone)
    return Judged(judge(unfaulted, got, "exact"), "the same prompt loaded from P with no fault", alone)


class _Drills:
    """The separate-hosts drills of one policy, on one set of servers."""

    def __init__(self, srv: Servers, case: Case, policy: str) -> None:
        self.srv, self.case, self.policy = srv, case, policy
        self.model = str(srv.model_dir)
        self.rng = np.random.default_rng(case.seed + 11)
        self.rule = default_rule(case)
        if srv.network is None:
            raise ValueError("the separate-hosts drills need a case with hosts netns")
        self.network = srv.network

    def prompt(self) -> list[int]:
        return random_prompt(self.rng, 3 * self.srv.recipe.block_size + 5)

    def log_mark(self) -> int:
        log = self.srv.d.log if self.srv.d else None
        return log.stat().st_size if log is not None and log.exists() else 0

    def faulted(self, params: dict[str, Any], prompt: list[int], bound_s: float, needles: tuple[str, ...],
                during: threading.Timer | None = None, readable: bool = False) -> tuple[dict[str, Any], list[str]]:
        """Send ``prompt`` to D with ``params`` (a fault between D and P in force), judge what D did."""
        srv = self.srv
        ref = complete(srv.d_url, self.model, prompt, self.case.max_tokens)
        mark, before = self.log_mark(), scrape(srv.d_url)
        facts: dict[str, Any] = {"policy": self.policy, "bound_s": bound_s}
        t0 = time.monotonic()
        if during is not None:
            during.start()
        got: Completion | None = None
        try:
            got = complete(srv.d_url, self.model, prompt, self.case.max_tokens, kv_transfer_params=params,
                           timeout_s=bound_s + 120)
            facts["answered"] = True
        except CompletionError as exc:
            facts["answered"], facts["status"] = False, exc.status
        except TimeoutError:  # no answer at all: judged past its bound below, the other drills still run
            facts["answered"], facts["status"] = False, "none (the client gave up)"
        facts["answer_s"] = round(time.monotonic() - t0, 2)
        if during is not None:
            during.join()
        moved = transfer_facts(delta(scrape(srv.d_url), before))
        facts["loaded"] = moved.get("transfers", 0.0) >= 1 and moved.get("failed_transfers", 0.0) == 0
        exact = False
        if got is not None:
            try:
                unfaulted = self.unfaulted(prompt) if facts["loaded"] else None
                judged = answer_reference(got, ref, unfaulted)
                exact = judged.verdict.ok
                facts.update(exact=exact, reference=judged.reference, verdict=judged.verdict.reason,
                             vs_d_alone=judged.d_alone.reason)
            except CompletionError as exc:  # no reference: the answer is not judged exact
                facts.update(exact=False, verdict=f"the same prompt loaded with no fault failed: {exc}")
        named = None
        if self.case.connector == "nixlkv":
            named = named_in_log(srv.d.log, mark, *needles) if srv.d else False
            facts["d_log_names"] = list(needles)
        facts["d_kv_usage_after"] = settled_kv_usage(srv.d_url)
        faults = judge_outcome(self.policy, facts["answered"], exact, facts["loaded"], facts["answer_s"], bound_s,
                               named, facts["d_kv_usage_after"], readable)
        return facts, faults

    def unfaulted(self, prompt: list[int]) -> Completion:
        """The same prompt prefilled on P and loaded by D with no fault in force: what an answer D
        decoded from a load must equal (its bytes are judged with every other load)."""
        params = prefill_on(self.srv.p_url, self.model, prompt)
        return complete(self.srv.d_url, self.model, prompt, self.case.max_tokens, kv_transfer_params=params,
                        timeout_s=120)

    def p_freed(self, facts: dict[str, Any], faults: list[str]) -> None:
        """P frees the faulted request's blocks (D's notification never came: at its lease)."""
        facts["p_kv_usage_after"] = settled_kv_usage(self.srv.p_url, timeout_s=LEASE_WAIT_S)
        if facts["p_kv_usage_after"] > 0:
            faults.append(f"P still holds KV ({facts['p_kv_usage_after']:.4f}) past its lease")

    def next_served(self, facts: dict[str, Any], faults: list[str]) -> None:
        """The next request, prefilled on a reachable P: decoded exactly from P's KV."""
        srv = self.srv
        prompt = self.prompt()
        try:
            ref = complete(srv.d_url, self.model, prompt, self.case.max_tokens)
            params = prefill_on(srv.p_url, self.model, prompt)
            before = scrape(srv.d_url)
            got = complete(srv.d_url, self.model, prompt, self.case.max_tokens, kv_transfer_params=params, timeout_s=120)
            moved = transfer_facts(delta(scrape(srv.d_url), before))
            verdict = judge(ref, got, self.rule)
            facts["next"] = {"verdict": verdict.reason or "ok", "transfers": moved.get("transfers", 0.0),
                             "bytes": moved.get("bytes", 0.0)}
            if not verdict.ok:
                faults.append(f"the next request: {verdict.reason}")
            if moved.get("transfers", 0.0) < 1 or moved.get("bytes", 0.0) <= 0:
                faults.append("the next request loaded nothing from P")
        except CompletionError as exc:
            faults.append(f"the next request failed: {exc}")

    # ------------------------------------------------------------------ the drills
    def loopback_advertised(self) -> Drill:
        """9: P started with its side channel on loopback; then P restarted as it should be."""
        prompt = self.prompt()
        params = prefill_on(self.srv.p_url, self.model, prompt)
        needles = ("loopback address", "side_channel_host") if self.case.connector == "nixlkv" else ()
        facts, faults = self.faulted(params, prompt, HANDSHAKE_TIMEOUT_S + SLACK_S, needles)
        facts["advertised"] = f"{params.get('remote_host')}:{params.get('remote_port')}"
        if params.get("remote_host") != LOOPBACK:
            faults.append(f"P advertised {params.get('remote_host')}, not loopback: the drill tested nothing")
        self.p_freed(facts, faults)
        spec = self.srv.p_spec
        config = {k: v for k, v in spec.extra_config.items() if k != "side_channel_host"}
        env = {k: v for k, v in spec.env.items() if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"}
        self.srv.p_spec = replace(spec, extra_config=config, env=env)
        facts["restart_s"] = round(self.srv.restart_prefill(), 1)
        self.next_served(facts, faults)
        return Drill("P advertises a loopback side channel", not faults, facts, "; ".join(faults))

    def closed_port(self) -> Drill:
        """10: the request names P's address and a port nothing listens on."""
        prompt = self.prompt()
        params = prefill_on(self.srv.p_url, self.model, prompt)
        port = int(params["remote_port"]) + CLOSED_PORT_OFFSET
        params = {**params, "remote_port": port}
        needles = (f"{params['remote_host']}:{port}", "side_channel_port") if self.case.connector == "nixlkv" else ()
        facts, faults = self.faulted(params, prompt, HANDSHAKE_TIMEOUT_S + SLACK_S, needles)
        facts["advertised"] = f"{params['remote_host']}:{port}"
        self.p_freed(facts, faults)
        self.next_served(facts, faults)
        return Drill("P advertises a closed side-channel port", not faults, facts, "; ".join(faults))

    def warm(self, faults: list[str]) -> None:
        """D reads from P once, so that a fault that follows finds D handshaken and connected."""
        facts: dict[str, Any] = {}
        self.next_served(facts, faults)

    def unreachable(self) -> Drill:
        """11: P's link dropped after P answered the prefill; restored once D answered."""
        needles = ("transfer_timeout_s",) if self.case.connector == "nixlkv" else ()
        return self._link_down("P unreachable mid-request", UNREACHABLE_S, UNREACHABLE_S + SLACK_S, needles,
                               readable=False, name_p=self.case.connector == "nixlkv")

    def link_dropped(self) -> Drill:
        """12: P's link down for LINK_DOWN_S from when the request is sent to D."""
        return self._link_down(f"a link dropped for {LINK_DOWN_S:g} s", LINK_DOWN_S, TRANSFER_TIMEOUT_S + SLACK_S, (),
                               readable=True, name_p=False)

    def _link_down(self, name: str, down_s: float, bound_s: float, needles: tuple[str, ...], readable: bool,
                   name_p: bool) -> Drill:
        """A request prefilled on P, P's link dropped as it is sent to D and restored ``down_s`` later:
        D must answer within ``bound_s``, its log naming ``needles`` (and P's address where
        ``name_p``), then hold no blocks and serve the next request from P."""
        faults: list[str] = []
        self.warm(faults)
        prompt = self.prompt()
        params = prefill_on(self.srv.p_url, self.model, prompt)
        self.network.set_link("prefill0", False)
        restore = threading.Timer(down_s, self.network.set_link, ("prefill0", True))
        try:
            named = (params["remote_host"], *needles) if name_p else needles
            facts, more = self.faulted(params, prompt, bound_s, named, during=restore, readable=readable)
        finally:
            restore.cancel()
            self.network.set_link("prefill0", True)
        facts["link_down_s"] = down_s
        faults += more
        self.p_freed(facts, faults)
        self.next_served(facts, faults)
        return Drill(name, not faults, facts, "; ".join(faults))


def host_case(case: Case) -> Case:
    """The drills' case: separate hosts, and D's timeouts as the drills bound them (nixlkv)."""
    config = dict(case.connector_config)
    if case.connector == "nixlkv":
        config.update(handshake_timeout_s=HANDSHAKE_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    return replace(case, hosts="netns", connector_config=tuple(config.items()))


def run_host_drills(case: Case, opts: Options, policy: str = "recompute") -> list[Drill]:
    case = host_case(case)
    lease_key = "lease_s" if case.connector == "nixlkv" else "kv_lease_duration"
    # P starts with its side channel left at loopback (drill 9), then is restarted as it should be
    p_extra = {lease_key: LEASE_S, **({"side_channel_host": LOOPBACK} if case.connector == "nixlkv" else {})}
    srv = Servers(case, opts, p_extra=p_extra, p_env={"VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK}, d_policy=policy,
                  tag=f"-hostdrill-{policy}")
    drills: list[Drill] = []
    with srv:
        srv.start()
        run = _Drills(srv, case, policy)
        for drill in (run.loopback_advertised, run.closed_port, run.unreachable, run.link_dropped):
            drills.append(drill())
    if srv.dump_dir is not None:  # every load that completed, judged per token and head against P's
        verdict = judge_dir(srv.dump_dir, allow_failed=True).summary()
        drills.append(Drill("bytes D loaded vs P's", verdict["ok"], {"bytes": verdict},
                            "" if verdict["ok"] else format_bytes(verdict)))
    return drills
