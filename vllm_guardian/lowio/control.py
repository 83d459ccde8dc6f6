"""The local control socket: how ``vllm-guardian status`` (and later pause/resume) talk to the daemon.

A Unix stream socket, mode 0600, created inside the runtime directory: only the guardian's
user (and root) can connect, so operator control never travels over HTTP. One JSON request
line in, one JSON response line out, then the connection closes. Bounded: see :class:`ControlServer`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm_guardian.lowio.control")

Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_REQUEST_BYTES = 64 * 1024
MAX_CLIENTS = 16  # connections served at once; past it the oldest still-reading one is cut
REQUEST_DEADLINE_SECONDS = 5.0  # to send the whole request line
ANSWER_DEADLINE_SECONDS = 10.0  # to take the whole answer


class _BadRequest(Exception):
    pass


class _TooLarge(_BadRequest):
    """The request line is over MAX_REQUEST_BYTES; ``ended``: its newline was read too (else the
    rest of it is still on its way)."""

    def __init__(self, message: str, *, ended: bool) -> None:
        super().__init__(message)
        self.ended = ended


@dataclass
class _Client:
    sock: socket.socket
    opened_monotonic: float
    reading: bool = True


class ControlServer:
    """Concurrent and bounded: a thread per client, at most MAX_CLIENTS, each under deadlines.

    A request past MAX_REQUEST_BYTES, one that is not a JSON object (deeply nested, not UTF-8 …)
    or one not complete within REQUEST_DEADLINE_SECONDS gets ``{"ok": false, "error": …}``; a
    handler that raises gets an internal error. None of it ends the server: the accept loop
    survives any error (``EMFILE`` included) and goes on serving.
    """

    def __init__(self, path: str | Path, handler: Handler) -> None:
        self.path = Path(path)
        self._handler = handler
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: no window in which others could connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        sock.settimeout(0.25)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                self._admit(conn)
            except Exception as e:  # EMFILE, no thread to be had …: the next one may work
                if self._stopping.is_set():
                    return
                log.warning("control socket: %s: %s (still serving)", type(e).__name__, e)
                self._stopping.wait(0.1)

    def _admit(self, conn: socket.socket) -> None:
        client = _Client(conn, time.monotonic())
        with self._lock:
            reading = [c for c in self._clients.values() if c.reading]
            if len(self._clients) >= MAX_CLIENTS and reading:
                oldest = min(reading, key=lambda c: c.opened_monotonic)
                oldest.reading = False
                with contextlib.suppress(OSError):
                    oldest.sock.shutdown(socket.SHUT_RDWR)
            self._clients[id(client)] = client
        try:
            threading.Thread(
                target=self._one, args=(client,), name="control-client", daemon=True
            ).start()
        except RuntimeError:
            self._forget(client)
            conn.close()
            raise

    def _forget(self, client: _Client) -> None:
        with self._lock:
            self._clients.pop(id(client), None)

    def _one(self, client: _Client) -> None:
        conn = client.sock
        try:
            deadline = client.opened_monotonic + REQUEST_DEADLINE_SECONDS
            unread = False
            try:
                line = _read_line(conn, deadline)
                client.reading = False
                response = self._answer(line)
            except _BadRequest as e:
                response = {"ok": False, "error": str(e)}
                unread = isinstance(e, _TooLarge) and not e.ended
            conn.settimeout(ANSWER_DEADLINE_SECONDS)
            conn.sendall((json.dumps(response) + "\n").encode())
            if unread:
                # Closing with the rest of the request unread would reset the connection, and
                # the client, still sending, would never read the answer: end our side, then
                # read and drop the rest of its line (within its deadline) before closing.
                conn.shutdown(socket.SHUT_WR)
                _discard_line(conn, deadline)
        except OSError:
            pass  # the client left or was cut: that client only
        except Exception:  # never end the server over one client
            log.exception("control request failed")
        finally:
            self._forget(client)
            conn.close()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            parsed = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            kind = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            return {"ok": False, "error": f"bad request: {kind}"}
        if not isinstance(parsed, dict):
            return {"ok": False, "error": "bad request: request must be a JSON object"}
        try:
            return self._handler(parsed)
        except ValueError as e:
            return {"ok": False, "error": f"bad request: {e}"}
        except Exception as e:
            log.exception("control command %r failed", parsed.get("cmd"))
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for c in self._clients.values():
                with contextlib.suppress(OSError):
                    c.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _read_line(conn: socket.socket, deadline_monotonic: float) -> bytes:
    buf = b""
    while b"\n" not in buf:
        left = deadline_monotonic - time.monotonic()
        if left <= 0:
            raise _BadRequest(
                f"no complete request line within the {REQUEST_DEADLINE_SECONDS:g}s deadline"
            )
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES and b"\n" not in buf[:MAX_REQUEST_BYTES]:
            raise _TooLarge(
                f"request too large (over {MAX_REQUEST_BYTES} bytes)", ended=b"\n" in buf
            )
    return buf.split(b"\n", 1)[0]


def _discard_line(conn: socket.socket, deadline_monotonic: float) -> None:
    """Read and drop what the client still sends, up to its newline or end, until the
    deadline (nothing is kept: a client that sends more only costs this thread that time)."""
    while (left := deadline_monotonic - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            return
        if not chunk or b"\n" in chunk:
            return


class ControlError(Exception):
    pass


def request(
    path: str | Path, payload: dict[str, Any], timeout_seconds: float = 5.0
) -> dict[str, Any]:
    """Send one request to a running daemon. Raises ControlError with a readable reason."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_seconds)
    try:
        _connect(sock, path, time.monotonic() + timeout_seconds)
        sock.sendall((json.dumps(payload) + "\n").encode())
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except FileNotFoundError:
        raise ControlError(f"no control socket at {path}: is the guardian running?") from None
    except PermissionError:
        raise ControlError(
            f"permission denied on {path}: run as the guardian's user or root"
        ) from None
    except ConnectionRefusedError:
        raise ControlError(f"nothing listens on {path}: the guardian is not running") from None
    except OSError as e:
        raise ControlError(f"{path}: {e}") from None
    finally:
        sock.close()
    try:
        result = json.loads(data)
    except json.JSONDecodeError:
        raise ControlError("the guardian sent an unreadable answer") from None
    if not isinstance(result, dict):
        raise ControlError("the guardian sent an unreadable answer")
    return result


def _connect(sock: socket.socket, path: str | Path, deadline_monotonic: float) -> None:
    """connect(), waiting out a full backlog (EAGAIN on a Unix socket) until the deadline."""
    while True:
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if time.monotonic() >= deadline_monotonic:
                raise
            time.sleep(0.05)
