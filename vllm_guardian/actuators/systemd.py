"""Actuator: restart a vLLM unit through systemd.

Where it sits: the act stage's restart backend when ``policy.backend: systemd``. It runs
``systemctl restart UNIT`` as an argument list (never a shell) with a timeout. Errors that
retrying cannot fix — an unknown unit, a refused permission (the polkit rule is missing) —
are terminal: the policy latches instead of retrying them.
"""

from __future__ import annotations

import subprocess


def classify_failure(returncode: int, stderr: str) -> tuple[bool, str]:
    """(terminal, detail) for a failed ``systemctl restart``."""
    text = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {returncode}"
    low = stderr.lower()
    if "not found" in low or "not loaded" in low:
        return True, f"{text} (check services[].unit)"
    if "access denied" in low or "authentication" in low or "permission" in low:
        return True, f"{text} (install the polkit rule: vllm-guardian install)"
    return False, text


class SystemdBackend:
    def __init__(self, unit: str, systemctl: str = "systemctl") -> None:
        self.unit = unit
        self.systemctl = systemctl

    def restart(self, timeout_seconds: float, drain: bool = True) -> tuple[bool, bool, str]:
        """Returns (ok, terminal, detail); never raises. ``drain`` changes nothing here: the
        unit's own ``TimeoutStopSec`` bounds its stop (docs/healing.md)."""
        del drain
        # "--": a unit name can never be read as an option, whatever the config let through.
        argv = [self.systemctl, "restart", "--no-ask-password", "--", self.unit]
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_seconds, check=False
            )
        except FileNotFoundError:
            return False, True, f"{self.systemctl} not found"
        except subprocess.TimeoutExpired:
            return (
                False,
                False,
                f"systemctl restart {self.unit} did not return within {timeout_seconds:.0f}s",
            )
        except OSError as e:
            return False, False, f"systemctl: {e}"
        if proc.returncode == 0:
            return True, False, f"systemctl restart {self.unit}"
        terminal, detail = classify_failure(proc.returncode, proc.stderr)
        return False, terminal, detail
