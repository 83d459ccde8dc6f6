"""The local control socket: how ``vllm-guardian status`` (and later pause/resume) talk to the daemon.

A Unix stream socket, mode 0600, created inside the runtime directory: only the guardian's
user (and root) can connect, so operator control never travels over HTTP. One JSON request
line in, one JSON response line out, then the connection closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_REQUEST_BYTES = 64 * 1024


class ControlServer:
    def __init__(self, path: str | Path, handler: Handler) -> None:
        self.path = Path(path)
        self._handler = handler
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

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
        sock.listen(8)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    request = _read_line(conn)
                    try:
                        parsed = json.loads(request)
                        if not isinstance(parsed, dict):
                            raise ValueError("request must be a JSON object")
                        response = self._handler(parsed)
                    except ValueError as e:
                        response = {"ok": False, "error": f"bad request: {e}"}
                    conn.sendall((json.dumps(response) + "\n").encode())
                except OSError:
                    continue

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return buf.split(b"\n", 1)[0]


class ControlError(Exception):
    pass


def request(
    path: str | Path, payload: dict[str, Any], timeout_seconds: float = 5.0
) -> dict[str, Any]:
    """Send one request to a running daemon. Raises ControlError with a readable reason."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_seconds)
    try:
        sock.connect(str(path))
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
