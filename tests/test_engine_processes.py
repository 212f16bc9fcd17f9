"""The check every forked engine process makes before it builds its engine (nixlkv.testing.processes):
importing NIXL leaves a process fresh, a NIXL agent does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nixlkv.testing import processes

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.nixl
def test_a_process_that_built_a_nixl_agent_is_refused_one_that_imported_nixl_is_not() -> None:
    """Negative control of check_fresh, in a fresh interpreter (this one may hold agents already)."""
    code = (
        "from nixlkv.testing.processes import check_fresh, ucx_libraries\n"
        "import nixl._api\n"
        "check_fresh()\n"
        "print('fresh after import', len(ucx_libraries()))\n"
        "from nixlkv.transport.agents import make_agent\n"
        "agent = make_agent('fresh-check')\n"
        "check_fresh()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"})
    assert "fresh after import 0" in out.stdout, out.stdout + out.stderr
    assert out.returncode != 0 and "ForkedStateError" in out.stderr and "libucp" in out.stderr, out.stderr


def test_the_check_names_the_ucx_libraries_and_only_them(monkeypatch) -> None:
    assert processes._UCX_LIB.search("/x/nixl_cu13.libs/libucp-b39b3ed9.so.0.0.0")
    assert processes._UCX_LIB.search("/x/ucx/libuct_cma.so.0.0.0")
    assert not processes._UCX_LIB.search("/x/.nixl_cu13.mesonpy.libs/libnixl.so")
    assert not processes._UCX_LIB.search("/x/libucx_perftest.so")
    monkeypatch.setattr(processes, "ucx_libraries", lambda: ["/x/libucs.so.0"])
    with pytest.raises(processes.ForkedStateError, match=r"libucs\.so\.0.*PRELOAD"):
        processes.check_fresh()
