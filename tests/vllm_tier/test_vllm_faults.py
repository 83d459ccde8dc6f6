"""The `vllm` tier: the test-only fault plugin makes the real vLLM fail through its own code.

A CPU vLLM cannot run out of GPU memory, but it fails the way a GPU vLLM fails when the plugin
(faults/vllm_guardian_faults.py) raises torch's own ``OutOfMemoryError``, with CUDA's text,
from the real model runner: vLLM's worker logs the traceback, its engine core logs the fatal
error and dies, the API server answers 500 and exits. What the guardian reads of it is checked
here, on the real lines: its log matcher names ``cuda_oom`` from the worker's traceback (the
sizes parsed) and the engine's death from the engine core. Then the cure the guardian's ladder
applies is applied by hand: the same prompt on a server relaunched with
``--max-num-batched-tokens`` at the budget is prefilled in chunks and served whole. On that
second server the gate's chat continuation is checked (chat_continuation.py), then the plugin's
other two faults follow: a hung engine core (streams stop, ``/health`` still 200) that then
raises (the engine's fatal error, the stream cut, the server gone).

Two vLLM starts: about a minute and a half on the 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from tests.support import wait_for
from tests.vllm_tier import support
from tests.vllm_tier.chat_continuation import check_a_cut_chat_stream_is_continued_byte_for_byte
from vllm_guardian.formats.vllm_log_format import match_line
from vllm_guardian.model import LogEventKind
from vllm_guardian.tools.demo import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BUDGET_TOKENS = 256  # the plugin's activation budget: a step over it "does not fit"
PROMPT_TOKENS = 400  # one prefill step of 400 at --max-num-batched-tokens 512; two chunks at 256
FLAGS = ("--max-model-len", "2048", "--num-gpu-blocks-override", "32", "--max-num-seqs", "8",
         "--shutdown-timeout", "5")  # fmt: skip
REPORT: dict[str, object] = {}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def events(self) -> list[tuple[LogEventKind, dict[str, str], str]]:
        out = []
        for line in self.lines():
            found = match_line(line)
            if found is not None:
                out.append((found[0], dict(found[1]), line))
        return out


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    return support.vllm_venv_or_skip()


@pytest.fixture(scope="module")
def tiny_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    support.build_model(vllm_venv, out)
    return out


@contextmanager
def serving(
    venv: Path, model: Path, workdir: Path, faults: dict[str, str], flags: tuple[str, ...]
) -> Iterator[Server]:
    run_id = uuid.uuid4().hex
    port = free_port()
    env = support.vllm_env(run_id, workdir, faults=faults)
    command = support.serve_command(venv, model, port, env, (*FLAGS, *flags))
    log: IO[bytes] = (workdir / "vllm.log").open("wb")
    census = support.Census(run_id).start()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, workdir / "vllm.log")
    try:
        wait_for(
            lambda: support.healthy(server.url) or proc.poll() is not None,
            "vLLM /health",
            240,
            every_seconds=support.POLL_SECONDS,
        )
        assert proc.poll() is None, "\n".join(server.lines()[-40:])
        yield server
    finally:
        support.stop_group(proc, 60)
        log.close()
        support.sweep(run_id, census)
        left = support.leftovers(run_id, census=census)
        census.stop()
        assert not left, f"vLLM processes left behind: {left}"


def _health(url: str) -> int | str:
    try:
        return support.session().get(url + "/health", timeout=5).status_code
    except Exception as e:  # refused once the server is gone: that is an answer too
        return type(e).__name__


def test_an_oom_in_the_forward_pass_fails_as_vllm_does_and_a_smaller_batch_cures_it(
    vllm_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    lock = support.host_lock()
    hang, die = tmp_path / "hang", tmp_path / "die"
    faults = {
        "VLLM_GUARDIAN_FAULT_OOM_ABOVE_TOKENS": str(BUDGET_TOKENS),
        "VLLM_GUARDIAN_FAULT_HANG_FILE": str(hang),
        "VLLM_GUARDIAN_FAULT_DIE_FILE": str(die),
    }
    prompt = support.prompt_ids(PROMPT_TOKENS, 11)
    try:
        # 1. Shipped-like flags: the prompt's one prefill step is over the budget.
        first = tmp_path / "first"
        first.mkdir()
        with serving(
            vllm_venv, tiny_model, first, faults, ("--max-num-batched-tokens", "512")
        ) as s:
            warm = support.stream_completion(s.url, support.prompt_ids(32, 1), 4)
            assert warm.done, warm  # a step under the budget is served
            cut = support.stream_completion(s.url, prompt, 16)
            wait_for(
                lambda: s.proc.poll() is not None,
                "vLLM to exit after the OOM",
                120,
                every_seconds=support.POLL_SECONDS,
            )
            events = s.events()
            REPORT["oom"] = {
                "stream": cut.__dict__,
                "exit_status": s.proc.returncode,
                "kinds": [e[0].value for e in events],
            }
            print("\nfaults tier, OOM:", json.dumps(REPORT["oom"], indent=1, default=str))
            # vLLM's answer to a stream whose engine died: an error event (then [DONE]).
            assert cut.chunks == 0 and cut.error and "EngineCore" in cut.error, cut
            ooms = [e for e in events if e[0] is LogEventKind.CUDA_OOM]
            assert ooms, "\n".join(s.lines()[-60:])
            # From the worker's (or engine core's) own traceback, with the step's sizes.
            assert all(e[2].startswith(("(Worker", "(EngineCore")) for e in ooms), ooms
            tried = PROMPT_TOKENS * 2 * 1024 * 1024
            assert abs(int(ooms[0][1]["tried_bytes"]) - tried) < 16 << 20, ooms[0]
            assert {LogEventKind.ENGINE_FATAL, LogEventKind.ENGINE_DEAD} & {e[0] for e in events}
        # 2. The ladder's cure by hand: chunks at the budget, the same prompt served whole.
        second = tmp_path / "second"
        second.mkdir()
        with serving(
            vllm_venv, tiny_model, second, faults,
            ("--max-num-batched-tokens", str(BUDGET_TOKENS)),
        ) as s:  # fmt: skip
            whole = support.stream_completion(s.url, prompt, 16)
            assert whole.done and whole.chunks == 16, whole
            assert not [e for e in s.events() if e[0] is LogEventKind.CUDA_OOM]
            # The gate's chat continuation, on this server while it serves (its own vLLM
            # start would cost CI half a minute): chat_continuation.py.
            check_a_cut_chat_stream_is_continued_byte_for_byte(s.url, tiny_model)
            # 3. A hang: the engine core stops stepping; /health still says 200.
            hang.touch()
            got: list[support.StreamResult] = []
            first_token = threading.Event()
            t = threading.Thread(
                target=lambda: got.append(
                    support.stream_completion(s.url, support.prompt_ids(32, 2), 64,
                                              first_token=first_token)
                ),
                daemon=True,
            )  # fmt: skip
            t.start()
            time.sleep(5)  # a hang is the absence of progress: there is no event to wait for
            health_while_hung = _health(s.url)
            REPORT["hang"] = {"tokens_in_5s": first_token.is_set(), "health": health_while_hung}
            assert not first_token.is_set() and health_while_hung == 200, REPORT["hang"]
            # 4. Then an unexpected exception in the busy loop: the engine dies as vLLM makes it.
            die.touch()
            t.join(timeout=120)
            wait_for(
                lambda: s.proc.poll() is not None,
                "vLLM to exit after the fault",
                120,
                every_seconds=support.POLL_SECONDS,
            )
            kinds = [e[0] for e in s.events()]
            REPORT["die"] = {
                "stream": got[0].__dict__ if got else None,
                "exit_status": s.proc.returncode,
                "kinds": [k.value for k in kinds],
            }
            print("\nfaults tier, hang then die:", json.dumps(REPORT, indent=1, default=str))
            assert got and got[0].chunks == 0 and got[0].error, got
            assert LogEventKind.ENGINE_FATAL in kinds or LogEventKind.ENGINE_DEAD in kinds
            assert LogEventKind.CUDA_OOM not in kinds
    finally:
        lock.close()
