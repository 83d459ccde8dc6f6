"""The watchdog is pinged only when the tick did its work.

Under descriptor exhaustion (or a full or broken disk) the policy state and the audit log
stopped being written while ``WATCHDOG=1`` kept going out, so systemd never restarted the
guardian. Here the state directory is made unusable (a file where the directory should be:
this holds even for root) and the ping must stop; once the directory is back, it resumes.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_daemon import make


def test_no_watchdog_ping_while_the_policy_state_cannot_be_saved(tmp_path: Path):
    state_dir = tmp_path / "flight.jsonl.state"
    g, note = make(tmp_path)
    try:
        g.tick()
        assert note.messages[-1].endswith("WATCHDOG=1"), note.messages  # a healthy tick

        for p in sorted(state_dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        state_dir.rmdir()
        state_dir.write_text("not a directory\n")
        assert g.healing is not None
        g.handle_control({"cmd": "pause"})  # a change that must be saved (and audited)
        g.tick()
        assert "WATCHDOG=1" not in note.messages[-1], note.messages[-1]
        assert g.healing.persist_error() is not None

        state_dir.unlink()
        state_dir.mkdir()
        g.handle_control({"cmd": "resume"})  # the next decision is written: the audit is back
        g.tick()
        assert note.messages[-1].endswith("WATCHDOG=1"), (note.messages, g.healing.persist_error())
    finally:
        g.close()
