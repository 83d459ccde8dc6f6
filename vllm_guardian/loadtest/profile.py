"""The load shape and the limits of one loadtest: YAML profile and flags → a frozen ``Profile``.

The YAML form is validated by the config loader's machinery (``config.parse_document``, as
``core/alert_rules.parse_rules`` does): every unknown key, wrong type and out-of-bounds value is
reported at once with its key path and line. Flags override the profile's values. Everything
is bounded (steps, step length, total time, concurrency, rate, requests), so a typo cannot turn
a loadtest into a denial of service.

Also here: the prompts file (JSON lines, every broken line reported with its number) and the
URL guard (loopback and private addresses are fine, anything else needs a confirmation flag).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vllm_guardian.config import (
    ConfigError,
    ConfigInvalid,
    _bounds,
    _check_url,
    parse_document,
    read_text,
)

GIB = 1024**3
# Bounds that hold whatever the profile says: a loadtest is a tool, not a siege.
MAX_STEPS = 16
MAX_STEP_SECONDS = 600.0
MAX_TOTAL_SECONDS = 3600.0
MAX_CONCURRENCY = 1024
MAX_RATE_PER_SECOND = 1000.0
MAX_PROMPT_TOKENS = 1_000_000
MAX_PROMPTS_FILE_BYTES = 64 * 1024 * 1024
MAX_PROMPTS = 100_000
MAX_BAD_LINES_SHOWN = 20


@dataclass(frozen=True)
class LoadSpec:
    """What each request looks like and how many run at once."""

    # Uniform distributions of prompt and output lengths (tokens; the twin counts one per word).
    prompt_tokens_min: int = field(default=200, metadata=_bounds(1, MAX_PROMPT_TOKENS))
    prompt_tokens_max: int = field(default=800, metadata=_bounds(1, MAX_PROMPT_TOKENS))
    output_tokens_min: int = field(default=64, metadata=_bounds(1, MAX_PROMPT_TOKENS))
    output_tokens_max: int = field(default=256, metadata=_bounds(1, MAX_PROMPT_TOKENS))
    # Real prompts instead of synthetic ones: JSON lines {"prompt": "...", "max_tokens": N}.
    prompts_file: str | None = None
    # Share of each synthetic prompt that is one of a few common prefixes (system prompts).
    shared_prefix_ratio: float = field(default=0.0, metadata=_bounds(0.0, 1.0))
    # Streaming gives TTFT per request; without it only end-to-end latency is measured.
    stream: bool = True
    # A ramp: concurrency steps (closed loop: this many requests in flight at all times).
    ramp: tuple[int, ...] | None = field(default=None, metadata=_bounds(1, MAX_CONCURRENCY))
    # Or one fixed step: a concurrency (closed loop) or an arrival rate (open loop).
    concurrency: int | None = field(default=None, metadata=_bounds(1, MAX_CONCURRENCY))
    rate_per_second: float | None = field(default=None, metadata=_bounds(0.01, MAX_RATE_PER_SECOND))
    # How long each ramp step (or the fixed step) is held.
    step_seconds: float = field(default=60.0, metadata=_bounds(1, MAX_STEP_SECONDS))
    # A request that has not finished in this long counts as an error (timeout).
    request_timeout_seconds: float = field(default=120.0, metadata=_bounds(1, 3600))
    # Open loop: at most this many requests in flight; beyond it arrivals are dropped and
    # counted (a client that cannot keep up must not queue unboundedly).
    max_in_flight: int = field(default=256, metadata=_bounds(1, 4 * MAX_CONCURRENCY))
    seed: int = 0


@dataclass(frozen=True)
class Limits:
    """What a step must hold. A step that breaks one ends the run (the server is protected)."""

    # p99 latency SLOs as the client sees them; None: not a limit, only reported.
    p99_ttft_seconds: float | None = field(default=None, metadata=_bounds(0.001, 3600))
    p99_e2e_seconds: float | None = field(default=None, metadata=_bounds(0.001, 3600))
    # Failed requests over requests finished in the step.
    error_ratio: float = field(default=0.01, metadata=_bounds(0.0, 1.0))
    # The shipped VllmPreemptionRateHigh rule's threshold: sustained preemption is thrash.
    preemptions_per_second: float = field(default=0.5, metadata=_bounds(0.0, 1e6))
    # The shipped VllmGpuHeadroomLow rule's floor: below it the next large prefill OOMs.
    # Long-context traffic needs more: the unprofiled prefill workspace lives in this space.
    gpu_headroom_floor_bytes: int = field(default=1 * GIB, metadata=_bounds(0))


@dataclass(frozen=True)
class WatchSpec:
    """How the server is watched while the load runs (the guardian's own sources)."""

    # A sample per second sees a step's peak without loading /metrics.
    interval_seconds: float = field(default=1.0, metadata=_bounds(0.05, 60))
    # "nvml" (the driver), "file" (the twin's GPU state file, docs/gpu-state-file.md), "none".
    gpu_backend: str = field(
        default="nvml",
        metadata=_bounds(
            check=lambda v: None if v in ("nvml", "file", "none") else "must be nvml, file or none"
        ),
    )
    gpu_state_file: str | None = None
    # GPU indices the server uses; None: every GPU the source reports.
    gpus: tuple[int, ...] | None = field(default=None, metadata=_bounds(0, 1023))
    # Memory errors: the server's log file, or its systemd unit's journal.
    log_file: str | None = None
    unit: str | None = None


@dataclass(frozen=True)
class Profile:
    url: str | None = field(default=None, metadata=_bounds(check=_check_url))
    model: str | None = None
    load: LoadSpec = field(default_factory=LoadSpec)
    limits: Limits = field(default_factory=Limits)
    watch: WatchSpec = field(default_factory=WatchSpec)

    def steps(self) -> tuple[StepSpec, ...]:
        ld = self.load
        if ld.ramp is not None:
            return tuple(
                StepSpec(i, c, None, ld.step_seconds) for i, c in enumerate(ld.ramp, start=1)
            )
        if ld.rate_per_second is not None:
            return (StepSpec(1, None, ld.rate_per_second, ld.step_seconds),)
        return (StepSpec(1, ld.concurrency or 1, None, ld.step_seconds),)


@dataclass(frozen=True)
class StepSpec:
    index: int  # 1-based
    concurrency: int | None  # closed loop
    rate_per_second: float | None  # open loop
    duration_seconds: float

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"{self.rate_per_second:g}/s"


def doubling_ramp(max_concurrency: int) -> tuple[int, ...]:
    """1, 2, 4, … up to ``max_concurrency`` (included when it is not a power of two)."""
    out = [1]
    while out[-1] * 2 <= max_concurrency:
        out.append(out[-1] * 2)
    if out[-1] != max_concurrency:
        out.append(max_concurrency)
    return tuple(out)


def check(profile: Profile, filename: str = "<flags>") -> Profile:
    """Cross-field rules, the same message style as the loader's. Raises ConfigInvalid."""
    errs: list[ConfigError] = []
    ld = profile.load

    def err(path: str, message: str) -> None:
        errs.append(ConfigError(path, None, message))

    if ld.prompt_tokens_min > ld.prompt_tokens_max:
        err("load.prompt_tokens_min", "must not exceed load.prompt_tokens_max")
    if ld.output_tokens_min > ld.output_tokens_max:
        err("load.output_tokens_min", "must not exceed load.output_tokens_max")
    shapes = [k for k in ("ramp", "concurrency", "rate_per_second") if getattr(ld, k) is not None]
    if len(shapes) > 1:
        err(
            "load", f"give one of ramp, concurrency and rate_per_second, not {' and '.join(shapes)}"
        )
    if ld.ramp is not None:
        if not ld.ramp:
            err("load.ramp", "needs at least one step")
        if len(ld.ramp) > MAX_STEPS:
            err("load.ramp", f"takes at most {MAX_STEPS} steps")
        if list(ld.ramp) != sorted(ld.ramp):
            err("load.ramp", "steps must go up (a ramp finds the first step that breaks)")
    total = ld.step_seconds * (len(ld.ramp) if ld.ramp else 1)
    if total > MAX_TOTAL_SECONDS:
        err("load.step_seconds", f"the run would take {total:g} s, over {MAX_TOTAL_SECONDS:g} s")
    w = profile.watch
    if w.gpu_backend == "file" and not w.gpu_state_file:
        err("watch.gpu_state_file", "required with watch.gpu_backend: file")
    if w.log_file and w.unit:
        err("watch", "give one of log_file and unit")
    if errs:
        raise ConfigInvalid(filename, errs)
    return profile


def parse_profile(text: str, filename: str) -> Profile:
    """Profile YAML → Profile, or ConfigInvalid listing every error with key path and line."""
    return check(parse_document(Profile, text, filename), filename)


def load_profile(path: str | Path) -> Profile:
    return parse_profile(read_text(path), str(path))


def with_overrides(profile: Profile, **overrides: object) -> Profile:
    """Flags over the profile: ``section__key=value`` (None leaves the profile's value)."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.partition("__")
        if name:
            sections.setdefault(section, {})[name] = value
        else:
            top[key] = value
    for section, values in sections.items():
        top[section] = dataclasses.replace(getattr(profile, section), **values)
    return dataclasses.replace(profile, **top)


# --- the prompts file ------------------------------------------------------------------------


@dataclass(frozen=True)
class FilePrompt:
    prompt: str
    tokens: int  # whitespace words: the twin's count, an estimate for a real tokenizer
    max_tokens: int | None


class PromptsInvalid(Exception):
    """The prompts file cannot be used; ``problems`` holds one line per broken line."""

    def __init__(self, filename: str, problems: list[str]) -> None:
        self.filename = filename
        self.problems = problems
        super().__init__(f"{filename}: " + "; ".join(problems[:3]))


def load_prompts(path: str | Path) -> tuple[FilePrompt, ...]:
    """JSON lines ``{"prompt": str, "max_tokens": int?}``; blank lines are skipped."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_PROMPTS_FILE_BYTES:
            raise PromptsInvalid(str(p), [f"{size} bytes, over {MAX_PROMPTS_FILE_BYTES}"])
        raw_lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise PromptsInvalid(str(p), [f"cannot read: {e.strerror}"]) from None
    except UnicodeDecodeError:
        raise PromptsInvalid(str(p), ["not UTF-8 text"]) from None
    prompts: list[FilePrompt] = []
    problems: list[str] = []
    for n, line in enumerate(raw_lines, start=1):
        if not line.strip():
            continue
        problem = _prompt_problem(line)
        if isinstance(problem, str):
            problems.append(f"line {n}: {problem}")
        else:
            prompts.append(problem)
    if len(prompts) > MAX_PROMPTS:
        problems.append(f"{len(prompts)} prompts, more than {MAX_PROMPTS}")
    if not prompts and not problems:
        problems.append("no prompts in the file")
    if problems:
        shown = problems[:MAX_BAD_LINES_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"… and {len(problems) - len(shown)} more")
        raise PromptsInvalid(str(p), shown)
    return tuple(prompts)


def _prompt_problem(line: str) -> FilePrompt | str:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    if not isinstance(doc, dict):
        return 'expected an object like {"prompt": "..."}'
    prompt = doc.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return '"prompt" must be a non-empty string'
    max_tokens = doc.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        return '"max_tokens" must be a positive integer'
    unknown = sorted(set(doc) - {"prompt", "max_tokens"})
    if unknown:
        return f"unknown keys {unknown} (known: prompt, max_tokens)"
    return FilePrompt(prompt, len(prompt.split()), max_tokens)


# --- the URL guard ---------------------------------------------------------------------------


class Reach(StrEnum):
    LOOPBACK = "loopback"
    PRIVATE = "private"
    PUBLIC = "public"


def classify_url(url: str) -> Reach:
    """``loopback``, ``private`` or ``public`` by the addresses the host resolves to (the
    widest wins). Raises ValueError when the URL has no host or the host does not resolve."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"{url!r} has no host")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    reach = Reach.LOOPBACK
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if addr.is_loopback:
            continue
        if addr.is_private or addr.is_link_local:
            reach = Reach.PRIVATE
        else:
            return Reach.PUBLIC
    return reach
