"""The follower: opens and closes the gate from what the guardian and vLLM say, and reads the
KV pool for the KV-need admission.

Every ``poll_interval_seconds`` it asks, concurrently,

* the guardian's ``/ready/<service>`` (when ``--guardian`` is given): 200 open, 503 closed with
  the policy's reason (KV above the high watermark, a drain or restart in flight, vLLM not up);
  and whether a restart or relaunch of the guardian's is in progress (its ``restart_in_progress``
  field: the admission lets what it holds then wait up to ``restart_extra_wait_seconds``
  longer for the new engine);
* vLLM's own ``/health``: the guardian ticks every half second or more, while a restarted vLLM
  is refused or answers 503 at once, so the gate does not wait for the next tick to notice.

The gate is open when vLLM answers 200 and the guardian (if any, and reachable) says ready,
and no exchange saw the upstream die in the last ``suspect_seconds``. A ``/health`` that does
not answer within the poll's timeout (1 s at the default interval) is not a "no": vLLM's API
server answers it on the same event loop as the requests, so a busy server is slow to answer it
while it serves. An open gate stays open through ``health_grace_seconds`` of such silence and
closes when it lasts longer; a refused connection or a non-200 answer closes it at once, as
before. (A single slow answer closed the gate, and on a busy host held new requests for up to
20 s while vLLM served; a hung engine that still answers is the progress watch's case.) Nor
does the silence count while a byte of an answer has come from vLLM within the grace: its
loop is writing, so it is busy, not gone (an overloaded CPU vLLM left /health unanswered for
6-7 s while it streamed, and the gate held every new request). An
unreachable guardian does not close the gate: the service keeps serving on vLLM's own health,
as it would without the gate (a guardian restart must not take the service down with it). A
guardian that answers ``/ready`` late (busy, it answers between its ticks) is not unreachable:
its last answer stands through ``health_grace_seconds`` of silence, then it counts as gone. (A
single late answer opened a gate the guardian held, for a drain or KV pressure, and let new
requests into vLLM.) A refused connection is gone at once. Both polls go through
the proxy's own keep-alive client (``upstream.py``): ten a second, they are most of what an
idle gate does.

It reads vLLM's ``/metrics`` with the guardian's own parser, in a worker thread so a large
exposition never stalls the proxy, for two uses:

* the KV-need admission (when on), every ``kv_poll_interval_seconds``: the pool size from
  ``vllm:cache_config_info``, the usage from ``vllm:kv_cache_usage_perc``;
* the progress watch (:mod:`vllm_guardian.gate.progress`; ``stall_hold_seconds`` > 0), at least
  every tenth of ``stall_hold_seconds`` (1 s at the default): requests in vLLM and no progress
  (``core/progress.py``) for ``stall_hold_seconds`` holds new requests, until the engine is
  seen to move or the guardian's restart brings up an engine that processes them. While it
  holds, every poll also takes back what the hung engine holds (``take_back``: the proxy's
  pool closes the connections of the exchanges it can send again or continue), so they wait
  at the head of the queue for the restarted engine instead of inside the hung one. The gate
  then stays closed until the engine is a new one (``/health`` failed since, or vLLM's process
  start time changed) or the same one generates tokens again
  (:func:`~vllm_guardian.gate.progress.why_send_again`), at most ``take_back_wait_seconds``
  (what a taken back request may wait): the hold alone can end while the engine is still
  hung, and what was sent again into it then was lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import quote

from vllm_guardian.core.progress import ProgressReading
from vllm_guardian.formats import ready_format
from vllm_guardian.gate.admission import Admission
from vllm_guardian.gate.looplag import running_timeout
from vllm_guardian.gate.progress import EngineMark, ProgressWatch, why_send_again
from vllm_guardian.gate.upstream import UpstreamError, UpstreamPool
from vllm_guardian.sources.vllm_metrics import VllmParser, parse_vllm_metrics

log = logging.getLogger("vllm_guardian.gate")


# vLLM's /metrics: ~0.3 MiB for 8 engines; the guardian's own source allows 16 MiB (its default
# sources.vllm_metrics.max_body_bytes). Past it the body is not read on: memory stays bounded.
METRICS_MAX_BYTES = 16 * 1024 * 1024
# /health and the guardian's /ready answer in a few bytes.
SMALL_BODY_MAX_BYTES = 64 * 1024


def _accepts_late(e: UpstreamError) -> bool:
    """The connect timed out: the listen backlog is full (a busy server accepts late), which
    is silence, not a refusal."""
    return e.phase == "connect" and e.timed_out


class _Silence:
    """Since when a polled endpoint has not answered in time (the grace both polls get)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def answered(self) -> None:
        self._since = None

    def seconds(self, now: float) -> float:
        """How long it has been silent, this poll included (0 at its first silent poll)."""
        if self._since is None:
            self._since = now
        return now - self._since


class Follower:
    def __init__(
        self,
        admission: Admission,
        *,
        upstream: str,
        guardian: str | None,
        service: str,
        poll_interval_seconds: float,
        kv_poll_interval_seconds: float,
        suspect_seconds: float,
        stall_hold_seconds: float = 0.0,
        health_grace_seconds: float = 3.0,
        take_back: Callable[[], int] | None = None,
        take_back_wait_seconds: float = 0.0,
        last_answer_data: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.admission = admission
        self.upstream = upstream.rstrip("/")
        self.guardian = guardian.rstrip("/") if guardian else None
        self.service = service
        self.poll_interval_seconds = poll_interval_seconds
        self.kv_poll_interval_seconds = kv_poll_interval_seconds
        self.suspect_seconds = suspect_seconds
        self._suspect_until: float | None = None
        self._suspect_why = ""  # how the last exchange broke ("phase: error")
        self.health_grace_seconds = health_grace_seconds
        # When a byte of an answer last came from vLLM (time.monotonic(); the proxy's pool):
        # a /health that is silent while answers arrive is a busy server, not a silent one.
        self._last_answer_data = last_answer_data
        self._health_silence = _Silence()  # /health not answering in time
        self._guardian_silence = _Silence()  # ...and the guardian's /ready
        self._guardian_last: tuple[bool, str, bool] | None = None  # its last answer
        self.progress = ProgressWatch(stall_hold_seconds)
        self.take_back = take_back
        self.taken_back = 0  # exchanges taken back from a hung engine, in all
        self.take_back_wait_seconds = take_back_wait_seconds
        self._health_failures = 0  # /health refused or not 200 (not: silent), since the start
        # engine_mark's last answer, and the reading it was made from.
        self._mark: EngineMark | None = None
        self._mark_of: ProgressReading | None = None
        # The engine requests were taken back from, while they wait for another (None: none
        # wait), and until when the gate holds for them.
        self._taken_back_from: EngineMark | None = None
        self._taken_back_until = 0.0
        self._parser = VllmParser()
        self._warned_unknown = False
        self._warned_oversize = False
        self._timeout_seconds = max(1.0, 5 * poll_interval_seconds)
        # The polls of /health and /ready (10 a second by default) and the reads of /metrics on
        # the proxy's lean client: an idle gate took 0.63 % of a core with aiohttp's, 0.43 %
        # with it for the polls (docs/gate.md). It asks for no compression: vLLM's /metrics
        # (prometheus_client's exposition) is gzipped for a client that accepts gzip, on
        # vLLM's serving event loop, for a page that only crosses loopback.
        self._vllm_pool = UpstreamPool(self.upstream, connect_timeout_seconds=self._timeout_seconds)
        self._guardian_pool = (
            UpstreamPool(self.guardian, connect_timeout_seconds=self._timeout_seconds)
            if self.guardian
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.polls = 0
        # The last answers, for GET /gate/status: None until asked (or, for the guardian,
        # when there is none to follow or it did not answer).
        self.upstream_healthy: bool | None = None
        self.guardian_ready: bool | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._state_loop(), name="gate-follower")]
        if self.admission.limits.kv_admission or self.progress.hold_after_seconds > 0:
            self._tasks.append(loop.create_task(self._kv_loop(), name="gate-metrics"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._vllm_pool.close()
        if self._guardian_pool is not None:
            self._guardian_pool.close()

    def suspect(self, how: str) -> None:
        """An exchange saw the upstream die (``how``: its phase and error): hold new requests
        until it answers /health again."""
        self._suspect_until = time.monotonic() + self.suspect_seconds
        self._suspect_why = f"the upstream broke an exchange ({how[:120]}); waiting for /health"
        if self.admission.open:
            self.admission.set_state(False, self._suspect_why)

    # --- polling -----------------------------------------------------------------------------

    async def poll_once(self) -> None:
        (healthy, why), (verdict, answered) = await asyncio.gather(
            self._health(), self._guardian_ready()
        )
        self.polls += 1
        verdict = self._guardian_through_silence(verdict, answered, time.monotonic())
        if healthy is False:
            self._health_failures += 1
        healthy, why = self._through_silence(healthy, why, time.monotonic())
        self.upstream_healthy = healthy
        self.guardian_ready = verdict[0] if verdict is not None else None
        # An unreachable guardian says nothing of a restart: no longer wait for one.
        self.admission.set_restart_in_progress(verdict is not None and verdict[2])
        if self._suspect_until is not None:
            if healthy and time.monotonic() >= self._suspect_until:
                self._suspect_until = None
            else:
                healthy, why = False, self._suspect_why
        stalled = self.progress.stalled() if healthy else None
        if not healthy:
            self.admission.set_state(False, why)
        elif stalled is not None:
            self.admission.set_state(False, stalled)
            self._take_back(stalled)
        elif (waiting := self._waiting_for_new_engine(time.monotonic())) is not None:
            self.admission.set_state(False, waiting)
        elif verdict is not None and not verdict[0]:
            self.admission.set_state(False, f"guardian: {verdict[1]}")
        else:
            self.admission.set_state(True, "open")

    def engine_mark(self) -> EngineMark:
        """The engine as the polls tell it now (gate/progress.py, EngineMark); asked for
        every request sent, made anew only when a poll changed what it is made of."""
        reading, failures = self.progress.last, self._health_failures
        mark = self._mark
        if mark is None or self._mark_of is not reading or mark.health_failures != failures:
            mark = self._mark = EngineMark.of(reading, failures)
            self._mark_of = reading
        return mark

    def _take_back(self, why: str) -> None:
        """The engine is hung: what it holds and the gate can save is taken back (it waits
        for the restarted engine at the head of the queue; vLLM aborts what it had)."""
        if self.take_back is None:
            return
        taken = self.take_back()
        if taken:
            self.taken_back += taken
            if self._taken_back_from is None:
                self._taken_back_from = self.engine_mark()
            self._taken_back_until = time.monotonic() + self.take_back_wait_seconds
            log.warning("gate: %s; %d requests in it taken back, to be sent again", why, taken)

    def _waiting_for_new_engine(self, now: float) -> str | None:
        """Why the gate stays closed for the requests taken back from a hung engine (they go
        to the next engine, not into that one again), or None."""
        mark = self._taken_back_from
        if mark is None:
            return None
        why = why_send_again(mark, self.engine_mark())
        if why is None and now < self._taken_back_until:
            return "requests taken back from the hung engine wait for a new one"
        self._taken_back_from = None
        log.info(
            "gate: %s: the requests taken back from the hung engine are sent again",
            why or f"no new engine within {self.take_back_wait_seconds:g} s",
        )
        return None

    def _through_silence(self, healthy: bool | None, why: str, now: float) -> tuple[bool, str]:
        """``healthy`` None (no answer in time): still healthy if the last answer was, for
        ``health_grace_seconds`` from the first silent poll; then not."""
        if healthy is not None:
            self._health_silence.answered()
            return healthy, why
        silent = self._health_silence.seconds(now)
        if self.upstream_healthy and (
            silent < self.health_grace_seconds or self._answers_arrive(now)
        ):
            return True, "open"
        return False, f"{why}, silent for {silent:.1f} s"

    def _answers_arrive(self, now: float) -> bool:
        """A byte of an answer came from vLLM within the last ``health_grace_seconds``: its
        loop is writing (busy, it answers /health late), so its silence is not silence."""
        last = self._last_answer_data()
        return last is not None and now - last < self.health_grace_seconds

    def _guardian_through_silence(
        self, verdict: tuple[bool, str, bool] | None, answered: bool, now: float
    ) -> tuple[bool, str, bool] | None:
        """The guardian's verdict to follow: its answer; when it did not answer in time
        (``answered`` False), its last answer for ``health_grace_seconds`` from the first
        silent poll, then None (gone: the gate follows vLLM alone)."""
        if answered:
            self._guardian_silence.answered()
            self._guardian_last = verdict
            return verdict
        if self._guardian_silence.seconds(now) < self.health_grace_seconds:
            return self._guardian_last
        self._guardian_last = None
        return None

    async def _state_loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let one bad poll end the follower
                log.exception("gate: poll failed")
            await asyncio.sleep(self.poll_interval_seconds)

    async def _get_small(self, pool: UpstreamPool, target: str) -> tuple[int, bytes]:
        """GET a small answer: its status and at most SMALL_BODY_MAX_BYTES of its body.
        Raises UpstreamError or TimeoutError (not for an answer that arrived while the loop
        was not running: looplag.running_timeout)."""
        async with running_timeout(self._timeout_seconds):
            up = await pool.request("GET", target, (), None)
            try:
                body = await up.read_at_most(SMALL_BODY_MAX_BYTES)
                return up.status, body[:SMALL_BODY_MAX_BYTES]
            finally:
                up.release()  # a longer body than that: its connection is closed, not read on

    async def _health(self) -> tuple[bool | None, str]:
        """(True, _) 200; (False, why) refused, broken or not 200; (None, why) no answer in
        time, which :meth:`_through_silence` judges."""
        try:
            status, _ = await self._get_small(self._vllm_pool, "/health")
        except UpstreamError as e:
            if _accepts_late(e):
                return None, f"vLLM does not accept a connection within {self._timeout_seconds:g} s"
            return False, f"vLLM does not answer /health ({e})"
        except TimeoutError:
            return None, f"vLLM does not answer /health within {self._timeout_seconds:g} s"
        if status == 200:
            return True, "open"
        return False, f"vLLM /health answers {status}"

    async def _guardian_ready(self) -> tuple[tuple[bool, str, bool] | None, bool]:
        """The guardian's verdict (ready, reason, restart in progress), or None when there is
        none to ask, it knows no such service or it is gone (refused, broken); and whether it
        answered (False: no answer in time, which :meth:`_guardian_through_silence` judges)."""
        if self._guardian_pool is None:
            return None, True
        try:
            status, body = await self._get_small(
                self._guardian_pool, f"/ready/{quote(self.service, safe='')}"
            )
        except UpstreamError as e:
            return None, not _accepts_late(e)
        except TimeoutError:
            return None, False
        if status == 404:
            if not self._warned_unknown:
                log.warning("gate: the guardian knows no service %r", self.service)
                self._warned_unknown = True
            return None, True
        return (
            status == 200,
            ready_format.reason_of(body, "closed"),
            ready_format.restart_in_progress_of(body),
        ), True

    @property
    def metrics_interval_seconds(self) -> float:
        """How often vLLM's /metrics is read: the KV-need admission's cadence when it is on,
        else what the progress watch needs (a tenth of its hold, not more often than the KV
        cadence): one parse a second, not two, on a host with eight engines."""
        if self.admission.limits.kv_admission:
            return self.kv_poll_interval_seconds
        return max(self.kv_poll_interval_seconds, self.progress.hold_after_seconds / 10)

    async def _kv_loop(self) -> None:
        while True:
            try:
                await self.poll_kv()
            except Exception:
                self.progress.observe(time.monotonic(), None)
                log.exception("gate: reading vLLM's /metrics failed")
            await asyncio.sleep(self.metrics_interval_seconds)

    async def poll_kv(self) -> None:
        """Read vLLM's /metrics once: the KV pool for the admission, progress for the watch.
        Nothing read (no answer, not 200, over the cap) is no reading: the watch forgets."""
        body = await self._read_metrics()
        if body is None:
            self.progress.observe(time.monotonic(), None)
            return
        text = body.decode("utf-8", "replace")
        scrape = await asyncio.to_thread(parse_vllm_metrics, text, len(body), self._parser)
        self.progress.observe(time.monotonic(), ProgressReading.of(scrape))
        if not self.admission.limits.kv_admission:
            return
        capacity = 0
        used = 0.0
        for e in scrape.engines:
            cap = e.cache_config.capacity_tokens if e.cache_config is not None else None
            if cap is None:
                continue
            capacity += cap
            used += (e.kv_cache_usage_ratio or 0.0) * cap
        self.admission.set_kv(capacity or None, used, "cache_config_info")

    async def _read_metrics(self) -> bytes | None:
        """vLLM's /metrics page, whole; None when it does not answer 200 within the poll's
        timeout or is over METRICS_MAX_BYTES (not read on: memory stays bounded)."""
        try:
            async with running_timeout(self._timeout_seconds):
                up = await self._vllm_pool.request(
                    "GET", "/metrics", (("Accept-Encoding", "identity"),), None
                )
                try:
                    if up.status != 200:
                        return None
                    page = await up.read_at_most(METRICS_MAX_BYTES + 1)
                finally:
                    up.release()  # not read to its end: its connection is closed, not reused
        except (UpstreamError, TimeoutError):
            return None
        if len(page) > METRICS_MAX_BYTES:
            if not self._warned_oversize:
                log.warning(
                    "gate: vLLM's /metrics is over %d bytes: not read, the KV estimate keeps "
                    "its last value",
                    METRICS_MAX_BYTES,
                )
                self._warned_oversize = True
            return None
        self._warned_oversize = False
        return page
