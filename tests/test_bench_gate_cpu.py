"""bench/gate_cpu.py drives both proxies and reports CPU per event and per request (a tiny
load: the harness works, not a figure). nginx is skipped when absent, unless
VLLM_GUARDIAN_REQUIRE_TOOLS=1 (CI installs it: scripts/test)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from bench import gate_cpu
from tests.support import run_quick_bench

HAVE_NGINX = shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists()


@pytest.mark.skipif(
    not HAVE_NGINX and os.environ.get("VLLM_GUARDIAN_REQUIRE_TOOLS") != "1",
    reason="nginx is not installed (apt-get install nginx-light)",
)
def test_the_cpu_bench_measures_the_gate_and_nginx_per_event_and_per_request() -> None:
    out = run_quick_bench("gate_cpu.py")
    rows = {
        tuple(cells[:2]): cells
        for line in out.splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 11
    }
    for target in ("gate", "nginx", "splice", "lean", "lean-gate"):
        # Events and requests reached the client through each proxy, stalls are counted, and
        # the proxy's CPU per unit is a number (0 when it used less than a clock tick).
        sse = rows[("sse × 4", target)]
        assert re.fullmatch(r"[\d.]+ µs/event \(.*\)", sse[2]), sse
        assert float(sse[6]) > 0 and sse[9].isdigit(), sse
        assert re.fullmatch(r"[\d.]+|–", sse[4]), sse  # the kernel's share of it
        unary = rows[("unary × 2", target)]
        assert re.fullmatch(r"[\d.]+ µs/request \(.*\)", unary[2]), unary
        assert float(unary[6]) > 0, unary
    assert re.search(r"unary × 2: gate ÷ nginx = [\d.]+×", out), out
    # The floor of the gate's stack, measured beside it: a relay with nothing to do, and an
    # HTTP proxy with nothing of the gate's.
    assert re.search(r"unary × 2: splice ÷ nginx = [\d.]+×", out), out
    assert re.search(r"unary × 2: lean ÷ nginx = [\d.]+×", out), out
    assert re.search(r"unary × 2: lean-gate ÷ nginx = [\d.]+×", out), out


def test_each_run_records_the_interpreter_the_gates_ran_under() -> None:
    """Which Python, and how fast it runs bytecode: runs on other hosts or interpreters differ."""
    doc = gate_cpu.interpreter(sys.executable)
    assert doc["version"] == sys.version.split()[0], doc
    assert doc["executable"] == sys.executable, doc
    assert isinstance(doc["loop_ms"], int) and doc["loop_ms"] > 0, doc
