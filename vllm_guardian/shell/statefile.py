"""The policy state file: rungs, budget and breaker, saved after every tick and read at start.

Where it sits: the last step of the decide-and-act half (:mod:`vllm_guardian.shell.healing` saves the
state after each tick and loads it once at start-up). Writes are atomic (``atomicfile.write_atomic``: temp file,
fsync, rename), so a crash leaves the old state or the new one, never half of either.

Reading never stops start-up: a file that cannot be the state (not JSON, the wrong shape, an
unknown format or one newer than :data:`STATE_FORMAT`, nested deeper than any state, larger than :data:`MAX_STATE_BYTES`, not a
regular file) is renamed aside to ``<name>.corrupt`` with a warning, and the guardian starts
fresh — the conservative choice, since a fresh state has no rungs stepped down and a full
restart budget, and the cooldown after any action it then takes still applies.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from vllm_guardian.core import policy
from vllm_guardian.formats.recorder import from_jsonable, to_jsonable
from vllm_guardian.lowio.atomicfile import write_atomic

log = logging.getLogger("vllm_guardian.shell.healing")

# 1: a service's fields flat, then (under the same number) grouped into levels, hold-off and
# front door; 2: grouped. The number moved so that a guardian which knows only the flat
# fields sets a grouped file aside (an unknown format) instead of reading it and silently
# dropping its rungs, cooldown and front door. Both are read; a newer one is set aside.
STATE_FORMAT = 2
# A state with 64 services and every list at its cap is a few hundred KiB.
MAX_STATE_BYTES = 16 * 1024 * 1024


class _Unusable(ValueError):
    """The file exists but cannot be the policy state."""


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Unusable("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > MAX_STATE_BYTES:
                raise _Unusable(f"larger than {MAX_STATE_BYTES >> 20} MiB")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_state(path: Path) -> policy.PolicyState | None:
    """The saved policy state, or None. A corrupt file is renamed aside, never fatal."""
    try:
        raw = json.loads(_read(path).decode("utf-8"))
        if not isinstance(raw, dict):
            raise _Unusable(f"a JSON {type(raw).__name__}, not an object")
        _check_format(raw.get("format"))
        _group_flat_fields(raw["state"])
        state: policy.PolicyState = from_jsonable(policy.PolicyState, raw["state"])
        return state
    except FileNotFoundError:
        return None
    except RecursionError:
        _set_aside(path, "nested too deeply to be a policy state")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _set_aside(path, str(e))
    return None


def _check_format(found: object) -> None:
    if type(found) is not int or found < 1:  # not bool: JSON true would pass as 1
        raise _Unusable(f"unknown format {found!r}")
    if found > STATE_FORMAT:
        # Set aside, not left in place: the next tick's save would overwrite it, and a newer
        # guardian (after the downgrade is undone) can be given it back by renaming it.
        raise _Unusable(
            f"format {found}, written by a newer vllm-guardian; this one reads formats 1 to "
            f"{STATE_FORMAT}"
        )


# A state saved before a service's levels and hold-off were records (ServiceState.levels,
# ServiceState.hold_off) has their fields flat.
_GROUPS = {
    "levels": ("rungs", "last_step_up", "pinned_until", "operator_flags", "baseline"),
    "hold_off": ("cooldown_until", "backoff_until", "backoff_seconds", "backoff_voluntary_only"),
}


def _group_flat_fields(state: object) -> None:
    """A state saved before the levels, the hold-off and the front door were records of their
    own: each saved service's flat fields moved into them (in place)."""
    services = state.get("services") if isinstance(state, dict) else None
    for svc in services if isinstance(services, list) else ():
        if not isinstance(svc, dict):
            continue
        for group, names in _GROUPS.items():
            if group not in svc:
                flat = {k: svc.pop(k) for k in names if k in svc}
                if flat:
                    svc[group] = flat
        if "front_door" not in svc and "gate_open" in svc:
            svc["front_door"] = _front_door(svc)


def _front_door(svc: dict[str, Any]) -> dict[str, Any]:
    """The front door of a service saved with ``gate_open``, ``gate_reason`` and
    ``gate_closed_at``. Who closed it was not saved: its reason says when the exhaustion
    forecast did (it wrote its own prefix); else an action past its wait for a permit did; else
    KV pressure (the only other closer)."""
    is_open = svc.pop("gate_open")
    reason = svc.pop("gate_reason", "open")
    door: dict[str, Any] = {"reason": reason, "closed_at": svc.pop("gate_closed_at", None)}
    if is_open is False:
        action = svc.get("action")
        if isinstance(reason, str) and reason.startswith("forecast:"):
            door["holder"] = policy.FrontDoorHolder.FORECAST.value
        elif isinstance(action, dict) and action.get("phase") != "awaiting_permit":
            door["holder"] = policy.FrontDoorHolder.ACTION.value
        else:
            door["holder"] = policy.FrontDoorHolder.KV_PRESSURE.value
    return door


def _set_aside(path: Path, why: str) -> None:
    aside = path.with_name(path.name + ".corrupt")
    try:
        if aside.is_dir() and not aside.is_symlink():
            aside = path.with_name(f"{path.name}.corrupt.{os.getpid()}")
        os.replace(path, aside)
    except OSError:
        aside = path
    log.warning(
        "policy state %s is unreadable (%s): set aside as %s; starting fresh", path, why, aside
    )


def save_state(path: Path, state: policy.PolicyState) -> None:
    body = {"format": STATE_FORMAT, "state": to_jsonable(state)}
    write_atomic(path, json.dumps(body, separators=(",", ":")).encode(), 0o600)
