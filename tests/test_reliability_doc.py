"""docs/reliability.md states every limit and what the guardian does at it: each limit it gives
is the code's, and each config key it names is one the config reads.

Each row below is a phrase of the page built from the value in the code (a config default, a
module's constant); a changed default or a renamed key without the page fails here, naming the
phrase that is no longer true.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from vllm_guardian.actuators.flags import MAX_FILE_BYTES
from vllm_guardian.actuators.procmgr import Supervisor
from vllm_guardian.config import (
    Config,
    FleetConfig,
    GateConfig,
    PolicyConfig,
    SignalsConfig,
    VllmMetricsSourceConfig,
)
from vllm_guardian.core.diagnosis import CORROBORATION_SECONDS
from vllm_guardian.core.permit import MAX_PERMITS
from vllm_guardian.core.phase_records import (
    PERMIT_CALL_TIMEOUT_SECONDS,
    PERMIT_RETRY_SECONDS,
    RESTART_CALL_MARGIN_SECONDS,
    Phase,
    phase_limit_seconds,
)
from vllm_guardian.gate.proxy import ProxySettings
from vllm_guardian.gate.server import GateSettings
from vllm_guardian.lowio import control
from vllm_guardian.shell.healing import VLLM_EXIT_SECONDS
from vllm_guardian.shell.statefile import MAX_STATE_BYTES
from vllm_guardian.sources.logs import FILE_SLICE_BYTES

DOC = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()


def s(seconds: float) -> str:
    """Seconds as the page writes them: ``1,800 s``."""
    return f"{seconds:,g} s"


def b(n: int) -> str:
    """Bytes as the page writes them: ``16 MiB``, ``64 KiB``."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


P, F, S, G = PolicyConfig(), FleetConfig(), SignalsConfig(), GateConfig()
PROXY = ProxySettings(upstream="http://127.0.0.1:9")
GATE = GateSettings(PROXY)
PM = {k: v.default for k, v in inspect.signature(Supervisor.__init__).parameters.items()}
PREPARING_MARGIN = phase_limit_seconds(Phase.PREPARING, P) - P.bundle_timeout_seconds

PHRASES = [
    # actions, the fleet, stopping
    ("draining", f"`policy.drain_timeout_seconds` ({s(P.drain_timeout_seconds)})"),
    ("a hung engine's stop", f"waits only {s(PM['exit_timeout_seconds'])} for vLLM's exit"),
    ("the stop timeout",
     f"`policy.drain_timeout_seconds` + {s(VLLM_EXIT_SECONDS)} "
     f"({s(P.drain_timeout_seconds + VLLM_EXIT_SECONDS)})"),
    ("preparing", f"`policy.bundle_timeout_seconds` ({s(P.bundle_timeout_seconds)}) + "
                  f"{s(PREPARING_MARGIN)}"),
    ("the restart call", f"drain + ready timeouts + {s(RESTART_CALL_MARGIN_SECONDS)}"),
    ("VRAM", f"`policy.vram_release_timeout_seconds` ({s(P.vram_release_timeout_seconds)})"),
    ("ready", f"`policy.ready_timeout_seconds` ({s(P.ready_timeout_seconds)})"),
    ("stall", f"`signals.stall_seconds` ({s(S.stall_seconds)})"),
    ("gate's stall hold", f"`stall_hold_seconds` ({s(G.stall_hold_seconds)})"),
    ("permit try", f"one try within {s(PERMIT_CALL_TIMEOUT_SECONDS)}"),
    ("permit Leases", f"at most {MAX_PERMITS} Leases read"),
    ("permit retry", f"a refused try again after {s(PERMIT_RETRY_SECONDS)}"),
    ("permit wait", f"`fleet.wait_timeout_seconds` ({s(F.wait_timeout_seconds)})"),
    ("permit renewal",
     f"every third of `fleet.lease_ttl_seconds` (every {s(F.lease_ttl_seconds / 3)} of "
     f"{s(F.lease_ttl_seconds)})"),
    # the process manager's backoff: fixed, the supervisor's defaults
    ("backoff",
     f"restarted after {s(PM['restart_delay_seconds'])}, doubling after each run shorter than "
     f"{s(PM['stable_seconds'])}, up to {s(PM['restart_delay_max_seconds'])}"),
    # listeners and fetches
    ("control clients", f"{control.MAX_CLIENTS} clients at once"),
    ("control request",
     f"the request line within {s(control.REQUEST_DEADLINE_SECONDS)} and at most "
     f"{b(control.MAX_REQUEST_BYTES)}; the answer taken within "
     f"{s(control.ANSWER_DEADLINE_SECONDS)}"),
    ("/metrics body", f"`sources.vllm_metrics.max_body_bytes` "
                      f"({b(VllmMetricsSourceConfig().max_body_bytes)})"),
    # the gate
    ("body deadline", f"`services[].gate.body_timeout_seconds`, {s(G.body_timeout_seconds)})"),
    ("body rate floor",
     f"`services[].gate.body_min_rate_bytes_per_second`, {b(G.body_min_rate_bytes_per_second)}/s "
     f"over each {s(PROXY.body_rate_window_seconds)})"),
    ("body budget", f"`services[].gate.body_budget_bytes`, {b(G.body_budget_bytes)}, at least "
                    f"`services[].gate.max_body_bytes`, {b(G.max_body_bytes)}), else 503 after "
                    f"{s(PROXY.body_budget_wait_seconds)}"),
    ("malformed", "(logged at most once a minute, never a traceback)"
     if GATE.malformed_log_interval_seconds == 60 else "the interval changed"),
    # logs, files
    ("log agreement", f"within {s(CORROBORATION_SECONDS)} of the line"),
    ("log slices", f"read in {b(FILE_SLICE_BYTES)} slices"),
    ("state file", f"| {b(MAX_STATE_BYTES)}; JSON object"),
    ("flags file", f"a regular file, {b(MAX_FILE_BYTES)}, UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "phrase"), PHRASES, ids=[p[0] for p in PHRASES])
def test_the_page_states_the_limit_the_code_has(what: str, phrase: str) -> None:
    assert phrase in DOC, f"{what}: docs/reliability.md no longer says {phrase!r}"


# A key as the page names it: `policy.drain_timeout_seconds`, `services[].gate.body_budget_bytes`.
KEY = re.compile(r"`((?:services\[\]|policy|fleet|signals|sources|recorder|alerting)(?:\.\w+)+)`")


def _field_type(cls: type, name: str) -> type | None:
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in fields(cls)}:
        return None
    t = hints[name]
    for arg in (*typing.get_args(t), t):  # X | None, tuple[X, ...]
        if isinstance(arg, type) and is_dataclass(arg):
            return arg
    return t if isinstance(t, type) else object


def _resolves(key: str) -> bool:
    cls: type | None = Config
    for part in key.replace("[]", "").split("."):
        if cls is None or not is_dataclass(cls):
            return False
        cls = _field_type(cls, part)
    return cls is not None


def test_every_key_the_page_names_is_one_the_config_reads() -> None:
    keys = sorted(set(KEY.findall(DOC)))
    assert len(keys) >= 12, keys  # the pattern still finds the page's keys
    assert [k for k in keys if not _resolves(k)] == []
