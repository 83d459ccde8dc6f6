"""Actuator: the guardian-owned flags file that the vLLM unit reads.

Where it sits: the act stage, before a relaunch. How flags reach vLLM: the
operator's unit keeps its ``ExecStart`` and appends ``$VLLM_GUARDIAN_ARGS`` from
``EnvironmentFile=-/var/lib/vllm-guardian/<service>.env``; argparse takes the last occurrence
of a flag, so the guardian's values override the operator's.

Only whitelisted flags and environment variables with range-checked values are ever written,
and values never contain whitespace or quotes: systemd splits ``$VLLM_GUARDIAN_ARGS`` on
whitespace and nothing here goes through a shell. The write is atomic (temp file + rename).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_guardian.lowio.atomicfile import write_atomic

ARGS_VARIABLE = "VLLM_GUARDIAN_ARGS"


@dataclass(frozen=True)
class _IntRange:
    lo: int
    hi: int

    def __call__(self, v: str) -> str | None:
        if not re.fullmatch(r"[0-9]+", v) or not self.lo <= int(v) <= self.hi:
            return f"must be an integer in [{self.lo}, {self.hi}]"
        return None

    def __str__(self) -> str:
        return f"an integer in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class _FloatRange:
    lo: float
    hi: float

    def __call__(self, v: str) -> str | None:
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", v) or not self.lo <= float(v) <= self.hi:
            return f"must be a number in [{self.lo}, {self.hi}]"
        return None

    def __str__(self) -> str:
        return f"a number in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class _Switch:
    def __call__(self, v: str) -> str | None:
        return None if v == "" else "takes no value"

    def __str__(self) -> str:
        return "a switch, no value"


@dataclass(frozen=True)
class _Choice:
    values: tuple[str, ...]

    def __call__(self, v: str) -> str | None:
        return None if v in self.values else f"must be one of {', '.join(self.values)}"

    def __str__(self) -> str:
        return f"one of {', '.join(self.values)}"


# vLLM's --load-format values an operator may switch between with `vllm-guardian relaunch
# --set load_format=…`: vllm preload's weight cache (ipc_cache, 0.31+) and the loads that read
# the same checkpoint from disk with no further configuration (back to disk when the cache's
# daemon is down). Never "dummy" (random weights) nor formats that need a path or a config.
LOAD_FORMATS = ("auto", "safetensors", "pt", "hf", "fastsafetensors", "instanttensor", "ipc_cache")

# The only flags the guardian may ever set, with what each value must be.
FLAGS: dict[str, Callable[[str], str | None]] = {
    "--max-num-seqs": _IntRange(1, 100_000),
    "--max-num-batched-tokens": _IntRange(16, 10_000_000),
    "--gpu-memory-utilization": _FloatRange(0.05, 0.99),
    "--kv-cache-memory-bytes": _IntRange(1 << 20, 1 << 44),
    "--enable-chunked-prefill": _Switch(),
    "--enforce-eager": _Switch(),
    "--load-format": _Choice(LOAD_FORMATS),
}


def _alloc_conf(v: str) -> str | None:
    if v in ("expandable_segments:True", "expandable_segments:False"):
        return None
    return "must be expandable_segments:True or expandable_segments:False"


# torch's allocator settings, under both names torch reads. torch parses one of them, and which
# one wins when both are set depends on its version: torch 2.13 (vLLM 0.32's build; measured
# with torch._C._accelerator_getAllocatorSettings) parses PYTORCH_CUDA_ALLOC_CONF and ignores
# PYTORCH_ALLOC_CONF; c10/core/AllocatorConfig.cpp at other commits parses PYTORCH_ALLOC_CONF
# first and calls the other deprecated; torch before 2.9 knows only PYTORCH_CUDA_ALLOC_CONF.
# So the lever writes both, each holding the lever's key (merged_env).
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
ENV: dict[str, Callable[[str], str | None]] = dict.fromkeys(ALLOC_CONF_NAMES, _alloc_conf)


class FlagsRejected(ValueError):
    """A flag or value outside the whitelist: nothing was written."""


@dataclass(frozen=True)
class FlagsContent:
    flags: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]

    @property
    def argv(self) -> tuple[str, ...]:
        out: list[str] = []
        for flag, value in self.flags:
            out.append(flag)
            if value:
                out.append(value)
        return tuple(out)


def validate(flags: Sequence[tuple[str, str]], env: Sequence[tuple[str, str]]) -> FlagsContent:
    problems = []
    for flag, value in flags:
        check = FLAGS.get(flag)
        if check is None:
            problems.append(f"{flag}: not a flag the guardian may set")
        elif (why := check(value)) is not None:
            problems.append(f"{flag} {value!r}: {why}")
    for name, value in env:
        check = ENV.get(name)
        if check is None:
            problems.append(f"{name}: not a variable the guardian may set")
        elif (why := check(value)) is not None:
            problems.append(f"{name}={value!r}: {why}")
    if problems:
        raise FlagsRejected("; ".join(problems))
    return FlagsContent(tuple(flags), tuple(env))


def _alloc_conf_items(conf: str) -> list[tuple[str, str]]:
    """``key:value`` pairs of an allocator setting, split at top-level commas (a list value
    such as ``roundup_power2_divisions:[256:1,>:4]`` holds commas of its own); blanks dropped,
    as torch's tokenizer drops them."""
    items: list[tuple[str, str]] = []
    depth = 0
    part = ""
    for c in conf.replace(" ", "") + ",":
        if c == "," and depth == 0:
            if part:
                key, _, value = part.partition(":")
                items.append((key, value))
            part = ""
            continue
        depth += (c == "[") - (c == "]")
        part += c
    return items


def merged_env(inherited: Mapping[str, str], guardian: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The environment vLLM starts with: ``inherited`` (the operator's) with the guardian's
    variables on top, except torch's allocator settings, which are merged. Each of the two
    names gets the operator's own value under that name (or, where the operator set only the
    other name, that one: torch would have read it) with the guardian's keys replacing or
    joining its keys. Whichever name a torch version reads, it finds the operator's setting
    and the lever's key: the lever never loses to, nor wipes out, the operator's setting."""
    env = dict(inherited)
    mine = dict(guardian)
    env.update({k: v for k, v in mine.items() if k not in ALLOC_CONF_NAMES})
    wanted = [mine[n] for n in ALLOC_CONF_NAMES if n in mine]
    if not wanted:
        return env
    operator = {n: inherited[n] for n in ALLOC_CONF_NAMES if n in inherited}
    for name in ALLOC_CONF_NAMES:
        base = operator.get(name, next(iter(operator.values()), ""))
        items = dict(_alloc_conf_items(base))
        for key, value in _alloc_conf_items(wanted[0]):
            items.pop(key, None)  # the guardian's key goes last, replacing the operator's
            items[key] = value
        env[name] = ",".join(f"{k}:{v}" for k, v in items.items())
    return env


def render(content: FlagsContent) -> str:
    lines = [
        "# Written by vllm-guardian: the flags it currently asks vLLM to run with.",
        "# Do not edit; `vllm-guardian status` shows why each is here.",
        f"{ARGS_VARIABLE}={' '.join(content.argv)}",
    ]
    lines += [f"{name}={value}" for name, value in content.env]
    return "\n".join(lines) + "\n"


def parse(text: str) -> FlagsContent:
    """Read a flags file back (validated: a tampered file is rejected, not obeyed)."""
    flags: list[tuple[str, str]] = []
    env: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise FlagsRejected(f"not NAME=value: {line!r}")
        if name == ARGS_VARIABLE:
            argv = value.split()
            i = 0
            while i < len(argv):
                flag = argv[i]
                takes_value = flag in FLAGS and FLAGS[flag]("") is not None
                if takes_value and i + 1 < len(argv):
                    flags.append((flag, argv[i + 1]))
                    i += 2
                else:
                    flags.append((flag, ""))
                    i += 1
        else:
            env.append((name, value))
    return validate(flags, env)


def path_for(state_dir: str | Path, service: str) -> Path:
    return Path(state_dir) / f"{service}.env"


def write(path: Path, content: FlagsContent) -> None:
    """Atomically replace the flags file (0644: the vLLM unit's user must read it)."""
    write_atomic(path, render(content).encode(), 0o644)


# A real flags file is a few hundred bytes; anything this large was not written by us.
MAX_FILE_BYTES = 64 * 1024


def read(path: Path) -> FlagsContent | None:
    """The flags file's content; None when there is none. Anything unreadable (not a regular
    file, not UTF-8, oversized, unreadable) is FlagsRejected with the reason, like a tampered
    file: the caller starts vLLM with its base flags and says why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FlagsRejected(f"cannot read {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FlagsRejected(f"{path} is not a regular file")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError as e:
        raise FlagsRejected(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise FlagsRejected(f"{path} is larger than {MAX_FILE_BYTES // 1024} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FlagsRejected(f"{path} is not UTF-8 text (byte {e.start})") from None
    return parse(text)
