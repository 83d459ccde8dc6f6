"""The gate as it is deployed: from the guardian's config, as its own process under sd_notify,
read by the guardian's gate source.

* the ``gate:`` section: defaults equal to the flags', errors with key and line, addresses that
  collide with vLLM, the guardian or another gate;
* ``vllm-guardian gate -c CONFIG --service NAME``: the config's values, flags override, bad
  service or missing section said plainly (exit 2), a busy port (exit 1);
* a real gate process on loopback in front of a scriptable stub: ``READY=1`` and repeated
  ``WATCHDOG=1`` on a real notify socket, and the guardian's :class:`GateCollector` reading its
  in-flight and queued requests, then an unreachable gate within the deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.support import wait_for
from tests.test_gate_support import Stub
from vllm_guardian.config import ConfigInvalid, GateConfig, GateSourceConfig, parse_config
from vllm_guardian.gate import cli as gate_cli
from vllm_guardian.model import GateObservation, ServiceSnapshot, Snapshot, SourceKind
from vllm_guardian.shell.exposition import GuardianCollector, Published, make_registry
from vllm_guardian.sources.gate import GateCollector, parse_status, read_status

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_text(vllm: str, gate_listen: str, extra: str = "") -> str:
    return f"""\
listen: 127.0.0.1:9469
services:
  - name: vllm
    url: {vllm}
    gate:
      listen: {gate_listen}
{extra}"""


# --- the config section ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("max_queue_requests", "max_queue"),
        ("max_queued_tokens", "max_queued_tokens"),
        ("max_wait_seconds", "max_wait"),
        ("release_rate_per_second", "release_rate"),
        ("release_burst", "release_burst"),
        ("per_key_share_ratio", "per_key_share"),
        ("key_header", "key_header"),
        ("known_keys_sha256", "known_keys_sha256"),
        ("retry_after_seconds", "retry_after"),
        ("kv_reserve_ratio", "kv_reserve"),
        ("default_output_tokens", "default_output_tokens"),
        ("max_body_bytes", "max_body_bytes"),
        ("body_timeout_seconds", "body_timeout"),
        ("body_min_rate_bytes_per_second", "body_min_rate"),
        ("body_budget_bytes", "body_budget_bytes"),
        ("poll_interval_seconds", "poll_interval"),
        ("kv_poll_interval_seconds", "kv_poll_interval"),
        ("stall_hold_seconds", "stall_hold"),
        ("metrics_path", "metrics_path"),
        ("shutdown_timeout_seconds", "shutdown_timeout"),
    ],
)
def test_config_defaults_are_the_flags_defaults(field: str, flag: str) -> None:
    assert getattr(GateConfig(), field) == gate_cli.DEFAULTS[flag]


def test_listen_and_kv_defaults_agree() -> None:
    assert GateConfig().listen_address == gate_cli.DEFAULTS["listen"]
    assert ("on" if GateConfig().kv_admission else "off") == gate_cli.DEFAULTS["kv_admission"]
    assert ("on" if GateConfig().trust_key_header else "off") == gate_cli.DEFAULTS[
        "trust_key_header"
    ]


@pytest.mark.parametrize(
    ("gate_yaml", "line", "path", "message"),
    [
        ("      listen: nowhere\n", 6, "services[0].gate.listen", "must be HOST:PORT"),
        ("      listen: 127.0.0.1:8000\n", 6, "services[0].gate.listen", "services[0].url"),
        ("      listen: 0.0.0.0:9469\n", 6, "services[0].gate.listen", "the guardian's listen"),
        ("      listen: 127.0.0.1:8001\n      max_wait_seconds: 0\n", 7,
         "services[0].gate.max_wait_seconds", "must be >= 0.1"),
        ("      listen: 127.0.0.1:8001\n      per_key_share_ratio: 2\n", 7,
         "services[0].gate.per_key_share_ratio", "must be <= 1"),
        ("      listen: 127.0.0.1:8001\n      per_key_share_ratio: 0.25\n", 7,
         "services[0].gate.per_key_share_ratio", "needs known_keys_sha256 or trust_key_header"),
        ("      listen: 127.0.0.1:8001\n      known_keys_sha256: [sk-secret]\n", 7,
         "services[0].gate.known_keys_sha256[0]", "64 lowercase hex digits"),
        (f"      listen: 127.0.0.1:8001\n      known_keys_sha256: ['{'a' * 64}']\n"
         "      trust_key_header: true\n", 8,
         "services[0].gate.trust_key_header", "exclude each other"),
        ("      listen: 127.0.0.1:8001\n      kv_admission: maybe\n", 7,
         "services[0].gate.kv_admission", "expected true or false"),
        ("      listen: 127.0.0.1:8001\n      max_queue: 5\n", 7,
         "services[0].gate.max_queue", "unknown key"),
        ("      listen: 127.0.0.1:8001\n      key_header: 'a b'\n", 7,
         "services[0].gate.key_header", "HTTP header name"),
        ("      listen: 127.0.0.1:8001\n      metrics_path: metrics\n", 7,
         "services[0].gate.metrics_path", "starting with '/'"),
        ("      listen: 127.0.0.1:8001\n      body_timeout_seconds: 0\n", 7,
         "services[0].gate.body_timeout_seconds", "must be >= 1"),
        ("      listen: 127.0.0.1:8001\n      max_body_bytes: 64MiB\n      body_budget_bytes: 32MiB\n",
         8, "services[0].gate.body_budget_bytes", "at least max_body_bytes (64MiB)"),
        ("      listen: 127.0.0.1:8001\n      max_body_bytes: 512MiB\n", 7,
         "services[0].gate.body_budget_bytes", "at least max_body_bytes (512MiB)"),
    ],
)  # fmt: skip
def test_bad_gate_sections_are_named_with_key_and_line(
    gate_yaml: str, line: int, path: str, message: str
) -> None:
    text = (
        "listen: 127.0.0.1:9469\nservices:\n  - name: vllm\n    url: http://127.0.0.1:8000\n"
        "    gate:\n" + gate_yaml
    )
    with pytest.raises(ConfigInvalid) as e:
        parse_config(text, "c.yaml")
    found = [(err.line, err.path, err.message) for err in e.value.errors]
    assert any(ln == line and p == path and message in m for ln, p, m in found), found


def test_two_gates_on_one_port_are_refused() -> None:
    text = """\
services:
  - name: a
    url: http://127.0.0.1:8000
    gate: {listen: "127.0.0.1:8101"}
  - name: b
    url: http://127.0.0.1:8002
    gate: {listen: "0.0.0.0:8101"}
"""
    with pytest.raises(ConfigInvalid) as e:
        parse_config(text, "c.yaml")
    assert [(x.line, x.path) for x in e.value.errors] == [(7, "services[1].gate.listen")], e.value
    assert "services[0].gate.listen" in str(e.value)


def test_a_service_without_gate_has_none_and_an_empty_section_takes_the_defaults() -> None:
    cfg = parse_config(config_text("http://127.0.0.1:8000", "127.0.0.1:8001"))
    assert cfg.services[0].gate == GateConfig()
    plain = parse_config("services:\n  - name: vllm\n")
    assert plain.services[0].gate is None


# --- vllm-guardian gate -c ---------------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(
        config_text(
            "http://127.0.0.1:8000",
            "127.0.0.1:8123",
            "      max_queue_requests: 7\n      kv_admission: false\n      max_wait_seconds: 9\n",
        )
    )
    return p


def test_gate_runs_from_the_config(config_file: Path) -> None:
    args = gate_cli.build_parser().parse_args(["-c", str(config_file), "--service", "vllm"])
    s = gate_cli.settings_from_args(args)
    assert (s.listen_host, s.listen_port) == ("127.0.0.1", 8123)
    assert s.proxy.upstream == "http://127.0.0.1:8000"
    assert s.guardian == "http://127.0.0.1:9469"
    assert s.proxy.service == "vllm"
    assert s.limits.max_queue_requests == 7
    assert s.limits.kv_admission is False
    assert s.limits.max_wait_seconds == 9


def test_the_body_bounds_come_from_the_config_and_the_flags(tmp_path: Path) -> None:
    p = tmp_path / "config.yaml"
    extra = "      body_timeout_seconds: 12\n      body_min_rate_bytes_per_second: 4096\n"
    p.write_text(config_text("http://127.0.0.1:8000", "127.0.0.1:8123", extra))
    args = gate_cli.build_parser().parse_args(
        ["-c", str(p), "--service", "vllm", "--body-budget-bytes", str(64 * 1024 * 1024)]
    )
    proxy = gate_cli.settings_from_args(args).proxy
    assert proxy.body_timeout_seconds == 12
    assert proxy.body_min_rate_bytes_per_second == 4096
    assert proxy.body_budget_bytes == 64 * 1024 * 1024
    args = gate_cli.build_parser().parse_args(
        ["--upstream", "http://127.0.0.1:8000", "--body-budget-bytes", "1024"]
    )
    with pytest.raises(gate_cli.UsageError, match="--body-budget-bytes"):
        gate_cli.settings_from_args(args)


def test_who_counts_as_one_client_comes_from_the_config_and_the_flags(tmp_path: Path) -> None:
    digest = "b" * 64
    p = tmp_path / "config.yaml"
    extra = f"      per_key_share_ratio: 0.25\n      known_keys_sha256: ['{digest}']\n"
    p.write_text(config_text("http://127.0.0.1:8000", "127.0.0.1:8123", extra))
    args = gate_cli.build_parser().parse_args(["-c", str(p), "--service", "vllm"])
    s = gate_cli.settings_from_args(args)
    assert s.proxy.known_keys_sha256 == frozenset({digest})
    assert s.proxy.trust_key_header is False and s.limits.per_key_share_ratio == 0.25
    flags = ["--upstream", "http://127.0.0.1:8000", "--per-key-share", "0.25"]
    with pytest.raises(gate_cli.UsageError, match="--known-key-sha256 or --trust-key-header"):
        gate_cli.settings_from_args(gate_cli.build_parser().parse_args(flags))
    trusted = gate_cli.settings_from_args(
        gate_cli.build_parser().parse_args([*flags, "--trust-key-header", "on"])
    )
    assert trusted.proxy.trust_key_header is True


def test_flags_override_the_config(config_file: Path) -> None:
    args = gate_cli.build_parser().parse_args(
        [
            "-c",
            str(config_file),
            "--service",
            "vllm",
            "--max-queue",
            "3",
            "--listen",
            "127.0.0.1:9999",
        ]
    )
    s = gate_cli.settings_from_args(args)
    assert s.limits.max_queue_requests == 3
    assert s.listen_port == 9999
    assert s.limits.max_wait_seconds == 9  # not given: the config's


def test_without_config_the_flags_defaults_apply() -> None:
    args = gate_cli.build_parser().parse_args(["--upstream", "http://127.0.0.1:8000"])
    s = gate_cli.settings_from_args(args)
    assert (s.listen_host, s.listen_port, s.guardian) == ("127.0.0.1", 8001, None)
    assert s.limits.max_queue_requests == 1024


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--service", "nope"], "has no service 'nope' (its services: vllm)"),
        ([], None),  # --service defaults to vllm: fine
    ],
)
def test_unknown_service_is_said_plainly(
    config_file: Path, argv: list[str], message: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    args = gate_cli.build_parser().parse_args(["-c", str(config_file), *argv])
    if message is None:
        gate_cli.resolve(args)
        return
    with pytest.raises(gate_cli.UsageError, match=re.escape(message)):
        gate_cli.resolve(args)


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ("services:\n  - name: vllm\n", ["--service", "vllm"], "has no gate: section"),
        ("services: 3\n", ["--service", "vllm"], "the config is invalid"),
        (None, [], "--upstream is required without -c CONFIG"),
    ],
)
def test_bad_gate_invocations_exit_2_with_the_reason(
    tmp_path: Path, text: str | None, argv: list[str], message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    if text is not None:
        (tmp_path / "c.yaml").write_text(text)
        argv = ["-c", str(tmp_path / "c.yaml"), *argv]
    assert gate_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


# --- a real gate process ----------------------------------------------------------------------


class NotifySocket:
    """A real sd_notify socket (a unix datagram socket), collecting what the gate sends."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                self.messages.append(self.sock.recv(4096).decode())

    def count(self, line: str) -> int:
        return sum(line in m.splitlines() for m in list(self.messages))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="vg-gate-") as d:
        yield Path(d)


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.set_release()
    s.stop()


def start_gate(cfg: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_guardian", "gate", "-c", str(cfg), "--service", "vllm"],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop_gate(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


@pytest.mark.slow
def test_a_gate_process_reports_to_systemd_and_to_the_guardian(stub: Stub, short_dir: Path) -> None:
    port = free_port()
    cfg = short_dir / "config.yaml"
    # The stub doubles as the guardian (/ready/vllm), so the test can close the front door.
    stub_port = stub.port
    cfg.write_text(
        f"listen: 127.0.0.1:{stub_port}\nservices:\n  - name: vllm\n"
        f"    url: http://127.0.0.1:{stub_port}\n    gate:\n      listen: 127.0.0.1:{port}\n"
        "      kv_admission: false\n      release_rate_per_second: 0\n"
    )
    notify = NotifySocket(short_dir)
    # The collision check knows the stub is both: the config still names one port for each.
    proc = start_gate(cfg, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "300000"})
    gate = GateConfig(listen=f"127.0.0.1:{port}")
    collector = GateCollector(
        parse_config(cfg.read_text()).services[0], gate, GateSourceConfig(timeout_seconds=1.0)
    )
    pool = ThreadPoolExecutor(4)
    try:
        wait_for(lambda: notify.count("READY=1") == 1, "READY=1 on the notify socket")
        # WATCHDOG=1 keeps coming from the event loop, about every 0.1 s here.
        wait_for(lambda: notify.count("WATCHDOG=1") >= 5, "repeated WATCHDOG=1")
        assert any(m.startswith("STATUS=") or "\nSTATUS=" in m for m in notify.messages)

        r = collector.collect()
        assert r.source is SourceKind.GATE and r.error is None, r
        obs = r.payload
        assert isinstance(obs, GateObservation)
        assert (obs.reachable, obs.in_flight, obs.queued, obs.open) == (True, 0, 0, True), obs
        assert (obs.upstream_healthy, obs.guardian_ready) == (True, True), obs

        # One request in flight to vLLM (the stub holds it), as the guardian reads it.
        url = f"http://127.0.0.1:{port}"
        held = pool.submit(requests.post, f"{url}/v1/hold", json={"prompt": "x"}, timeout=60)
        wait_for(lambda: _obs(collector).in_flight == 1, "in_flight 1 through the source")
        # The guardian closes the front door: the next request waits in the gate's queue.
        stub.ready = False
        wait_for(lambda: _obs(collector).open is False, "the gate to close")
        queued = pool.submit(requests.post, f"{url}/v1/echo", json={"prompt": "y"}, timeout=60)
        wait_for(lambda: _obs(collector).queued == 1, "queued 1 through the source")
        o = _obs(collector)
        assert (o.in_flight, o.queued, o.guardian_ready) == (1, 1, False), o
        assert o.reason is not None and "draining" in o.reason, o
        # Open again, finish both: nothing left, counted as held.
        stub.ready = True
        stub.set_release()
        assert held.result(timeout=60).status_code == 200
        assert queued.result(timeout=60).status_code == 200
        wait_for(lambda: _obs(collector).in_flight == 0, "in_flight back to 0")
        o = _obs(collector)
        assert (o.queued, o.held_total, o.rejected_total) == (0, 1, 0), o
        assert o.arrived_total is not None and o.arrived_total >= 2, o  # the two POSTs, at least

        # Its /gate/status document, as the guardian's source parses it.
        doc = requests.get(f"{url}/gate/status", timeout=5).json()
        assert {"in_flight", "queue_depth", "open", "reason", "upstream_healthy",
                "guardian_ready", "oldest_wait_seconds", "longest_wait_seconds",
                "arrived_total", "held_total", "retried_total", "rejected_total",
                "unanswered", "oldest_unanswered_seconds"} <= set(doc)  # fmt: skip
        assert (doc["unanswered"], doc["oldest_unanswered_seconds"]) == (0, 0.0), doc

        # SIGTERM: STOPPING=1 and exit 0; then the source sees no gate, quickly, and says so.
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        wait_for(lambda: notify.count("STOPPING=1") == 1, "STOPPING=1")
        t0 = time.monotonic()
        r = collector.collect()
        assert time.monotonic() - t0 < 10  # refused at once; generous for a loaded machine
        assert isinstance(r.payload, GateObservation) and r.payload.reachable is False
        assert r.payload.in_flight is None and r.payload.queued is None
        assert r.error is not None and "refused" in r.error, r
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        out = stop_gate(proc)
        notify.close()
    assert "Traceback" not in out, out


def _obs(c: GateCollector) -> GateObservation:
    p = c.collect().payload
    assert isinstance(p, GateObservation)
    return p


@pytest.mark.slow
def test_a_busy_port_is_said_plainly(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = short_dir / "config.yaml"
        cfg.write_text(config_text("http://127.0.0.1:1", f"127.0.0.1:{port}"))
        proc = start_gate(cfg)
        assert proc.wait(timeout=60) == 1
        out = stop_gate(proc)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out, out
    assert "Traceback" not in out, out


# --- the source against servers that are not a healthy gate -----------------------------------


@contextlib.contextmanager
def raw_server(reply: bytes | None) -> Iterator[int]:
    """A TCP server on loopback that answers every connection with ``reply`` (None: never)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(c)
            if reply is not None:
                with contextlib.suppress(OSError):
                    c.recv(4096)
                    c.sendall(reply)
                    c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=5)
        for c in conns:
            c.close()
        srv.close()


def _http(status: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (None, "no answer within 0.5s"),
        (_http("200 OK", b"not json"), "not JSON"),
        (_http("200 OK", b"[1, 2]"), "not a JSON object"),
        (_http("200 OK", b'{"open": true}'), "no in_flight/queue_depth"),
        (_http("200 OK", b'{"in_flight": -1, "queue_depth": 0}'), "no in_flight/queue_depth"),
        (_http("404 Not Found", b"{}"), "answered HTTP 404"),
        (b"garbage\r\n\r\n", "BadStatusLine"),
    ],
)
def test_anything_but_a_gate_is_unreachable_with_the_reason(
    reply: bytes | None, error: str
) -> None:
    # A server that answers gets a deadline a busy machine cannot miss; the silent one 0.5 s.
    deadline_seconds = 0.5 if reply is None else 30.0
    with raw_server(reply) as port:
        t0 = time.monotonic()
        obs = read_status("127.0.0.1", port, deadline_seconds)
        took = time.monotonic() - t0
    print(f"read_status took {took:.2f} s: {obs.error}")
    assert obs.reachable is False and obs.in_flight is None, obs
    assert obs.error is not None and error in obs.error, obs
    if reply is None:  # the 0.5 s deadline holds (a read without one would hang)
        assert took < 15, took


def test_a_status_document_maps_to_the_observation() -> None:
    doc = {
        "in_flight": 3, "queue_depth": 2, "open": False, "reason": "guardian: draining",
        "upstream_healthy": True, "guardian_ready": False, "oldest_wait_seconds": 1.5,
        "held_total": 9, "retried_total": 1, "rejected_total": 0, "unknown_key": "ignored",
        "unanswered": 2, "oldest_unanswered_seconds": 31.5, "arrived_total": 40,
        "loop_lag_max_seconds": 2.5, "cpu_busy_share": 0.93,
    }  # fmt: skip
    assert parse_status(json.dumps(doc).encode()) == GateObservation(
        reachable=True, in_flight=3, queued=2, open=False, reason="guardian: draining",
        upstream_healthy=True, guardian_ready=False, oldest_wait_seconds=1.5,
        arrived_total=40, held_total=9, retried_total=1, rejected_total=0, unanswered=2,
        oldest_unanswered_seconds=31.5, loop_lag_max_seconds=2.5, cpu_busy_share=0.93,
    )  # fmt: skip


# --- exposition --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obs", "expected", "absent"),
    [
        (GateObservation(True, in_flight=4, queued=2),
         ['vllm_guardian_gate_up{service="vllm"} 1.0',
          'vllm_guardian_gate_reported_in_flight{service="vllm"} 4.0',
          'vllm_guardian_gate_reported_queued{service="vllm"} 2.0'], []),
        (GateObservation(False, error="connection refused"),
         ['vllm_guardian_gate_up{service="vllm"} 0.0'],
         ["vllm_guardian_gate_reported_in_flight", "vllm_guardian_gate_reported_queued"]),
        (None, [], ["vllm_guardian_gate_up"]),
    ],
)  # fmt: skip
def test_the_guardian_exports_what_the_gate_reported(
    obs: GateObservation | None, expected: list[str], absent: list[str]
) -> None:
    from prometheus_client import generate_latest

    from vllm_guardian.core.signals import derive

    cfg = parse_config("services:\n  - name: vllm\n")
    snap = Snapshot(1000.0, (ServiceSnapshot("vllm", gate=obs),), None)
    signals = derive([snap], cfg.services, cfg.signals)
    collector = GuardianCollector(["vllm"])
    collector.publish(Published(snap, signals, 0.01, None), 1.0)
    text = generate_latest(make_registry(collector, process_metrics=False)).decode()
    for line in expected:
        assert line in text, text
    for name in absent:
        assert name not in text, text


def test_the_guardians_gate_series_do_not_collide_with_the_gates_own() -> None:
    from vllm_guardian.gate.metrics import GateMetrics

    own = {f.name for f in GateMetrics("vllm").registry.collect()}
    ours = {"vllm_guardian_gate_up", "vllm_guardian_gate_reported_in_flight",
            "vllm_guardian_gate_reported_queued"}  # fmt: skip
    assert not own & ours, own & ours


def test_each_counters_total_is_what_its_scrape_says() -> None:
    """The status reads counters one by one (not the whole registry for each): every counter
    family is found and its labels summed. Each is counted a different number of times, so a
    counter read as another, or not found (0), shows."""
    from vllm_guardian.gate.metrics import NS, GateMetrics

    m = GateMetrics("vllm", cpu_clock=lambda: 41.0)
    bumps = [
        m.arrived.inc,
        m.admitted.inc,
        m.held.inc,
        m.retried.inc,
        m.stale_connections.inc,
        m.connect_timeouts.inc,
        lambda: m.rejected.labels("queue_full").inc(),
        lambda: m.upstream_error("streaming"),
        lambda: m.client_disconnect("queued"),
        lambda: m.malformed("head"),
        lambda: m.continuation("continued", "connection"),
        lambda: m.fallback("sent"),
        lambda: m.connection_closed("evicted"),
    ]
    for times, bump in enumerate(bumps, start=1):
        for _ in range(times):
            bump()
    m.rejected.labels("too_large").inc(100)
    m.continuation("failed", "client_gone")
    counters = {f.name: f for f in m.registry.collect() if f.type == "counter"}
    assert len(counters) == len(bumps) + 1, sorted(counters)  # and cpu_seconds
    for name, family in counters.items():
        scraped = sum(s.value for s in family.samples if s.name.endswith("_total"))
        assert scraped > 0, name  # every counter counted: none compares 0 with 0
        assert m.total(name.removeprefix(f"{NS}_")) == int(scraped), name
    assert (m.total("arrived"), m.total("held"), m.total("rejected")) == (1, 3, 107)
    assert m.total("cpu_seconds") == 41
    assert (m.continuations("continued"), m.continuations("failed")) == (11, 1)
    assert m.total("no_such_counter") == 0


# --- registry and snapshot ---------------------------------------------------------------------


def test_a_gate_section_adds_the_gate_source_and_its_reading_lands_on_the_service() -> None:
    from vllm_guardian.lowio.clock import SystemClock
    from vllm_guardian.model import Reading, SourceStatus
    from vllm_guardian.shell.daemon import assemble
    from vllm_guardian.sources.registry import build_collectors

    cfg = parse_config(
        "services:\n  - name: a\n    url: http://127.0.0.1:8000\n    gate: {listen: '127.0.0.1:8101'}\n"
        "  - name: b\n    url: http://127.0.0.1:8002\n"
    )
    gates = [c for c in build_collectors(cfg, SystemClock()) if c.kind is SourceKind.GATE]
    assert [c.service for c in gates] == ["a"]
    for c in gates:
        c.close()
    obs = GateObservation(True, in_flight=2, queued=0)
    st = SourceStatus(SourceKind.GATE, "a", True, 0.01)
    snap = assemble(1.0, ["a", "b"], [Reading(SourceKind.GATE, "a", obs)], [st])
    assert snap.service("a") == ServiceSnapshot("a", gate=obs)
    assert snap.service("b") == ServiceSnapshot("b")


def test_the_example_config_spells_out_every_gate_key_with_its_default_and_a_reason() -> None:
    import dataclasses

    example = ROOT / "examples" / "config.yaml"
    cfg = parse_config(example.read_text(), str(example))
    assert cfg.services[0].gate == GateConfig()
    lines = example.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "gate:")
    for f in dataclasses.fields(GateConfig):
        idx = next(
            (
                i
                for i, line in enumerate(lines[start:], start)
                if line.strip().startswith(f"{f.name}:")
            ),
            None,
        )
        assert idx is not None, f"gate.{f.name} missing from examples/config.yaml"
        above = lines[idx - 1].strip()
        assert above.startswith("#") or lines[idx - 2].strip().startswith("#"), f.name


def test_check_config_names_each_gate_and_reports_a_bad_section_with_key_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_guardian.tools import cli

    good = tmp_path / "good.yaml"
    good.write_text(
        config_text("http://127.0.0.1:8000", "0.0.0.0:8001")
        + "  - name: other\n    url: http://127.0.0.1:8002\n"
    )
    assert cli.main(["check-config", "-c", str(good)]) == 0
    out = capsys.readouterr().out
    assert "gate for vllm: clients on 0.0.0.0:8001 -> http://127.0.0.1:8000" in out, out
    assert "other: no gate: section, clients reach http://127.0.0.1:8002 directly" in out, out
    bad = tmp_path / "bad.yaml"
    bad.write_text(config_text("http://127.0.0.1:8000", "127.0.0.1:8000"))
    assert cli.main(["check-config", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{bad}:6: services[0].gate.listen: 127.0.0.1:8000 is already services[0].url's address"
        in err
    ), err


def test_once_up_the_gate_freezes_what_start_up_allocated_and_sizes_the_young_generation() -> None:
    # In a process of its own: the collector's settings are the whole interpreter's.
    code = (
        "import gc\n"
        "from vllm_guardian.gate import cli\n"
        "assert gc.get_freeze_count() == 0\n"
        "cli.tame_collector()\n"
        "assert gc.get_freeze_count() > 0, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == cli.GC_GEN0_THRESHOLD, gc.get_threshold()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
