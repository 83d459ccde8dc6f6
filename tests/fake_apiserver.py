"""A protocol-level fake of the Kubernetes API server, for the fleet permit's adapter.

A real HTTP server on 127.0.0.1 answering the few calls the permit makes, as the API server
does (paths, JSON bodies, ``Status`` objects, codes):

* Leases (coordination.k8s.io/v1): GET, POST (409 AlreadyExists when it exists), PUT with
  ``metadata.resourceVersion`` as a precondition (409 Conflict when stale); every write bumps
  one global resourceVersion, as etcd's revision does;
* PodDisruptionBudgets (policy/v1): GET, with ``status`` computed from the pods' readiness the
  way the disruption controller does (``disruptionsAllowed = currentHealthy - desiredHealthy``).

Not a Kubernetes: no auth, no watch, no admission, one namespace's worth of objects.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LEASES = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/?]+))?$")
PDB = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/?]+)$")


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


@dataclass
class FakeCluster:
    namespace: str = "llm"
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    pdbs: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → {maxUnavailable, pods}
    revision: int = 100
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # method, path, code
    tokens: set[str] = field(default_factory=set)  # the Authorization headers seen
    holders: list[str | None] = field(default_factory=list)  # each accepted Lease write's holder
    # Called (under the lock) before a PUT is applied: a test's way to make another writer win.
    before_put: Callable[[FakeCluster, str], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_pdb(self, name: str, max_unavailable: int, pods: dict[str, bool]) -> None:
        self.pdbs[name] = {"maxUnavailable": max_unavailable, "pods": dict(pods)}

    def set_ready(self, pdb: str, pod: str, ready: bool) -> None:
        with self.lock:
            self.pdbs[pdb]["pods"][pod] = ready

    def bump(self) -> str:
        self.revision += 1
        return str(self.revision)

    def pdb_object(self, name: str) -> dict[str, Any]:
        p = self.pdbs[name]
        expected = len(p["pods"])
        desired = max(0, expected - p["maxUnavailable"])
        healthy = sum(1 for r in p["pods"].values() if r)
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": "1"},
            "spec": {"maxUnavailable": p["maxUnavailable"], "selector": {"matchLabels": {}}},
            "status": {
                "currentHealthy": healthy,
                "desiredHealthy": desired,
                "expectedPods": expected,
                "disruptionsAllowed": max(0, healthy - desired),
                "observedGeneration": 1,
            },
        }

    def holder(self, name: str) -> str | None:
        with self.lock:
            lease = self.leases.get(name)
            return None if lease is None else lease.get("spec", {}).get("holderIdentity")

    # --- the API --------------------------------------------------------------------------

    def handle(
        self, method: str, path: str, body: Any, auth: str | None
    ) -> tuple[int, dict[str, Any]]:
        path = path.split("?", 1)[0]
        with self.lock:
            self.tokens.add(auth or "")
            code, out = self._handle(method, path, body)
            self.requests.append((method, path, code))
            return code, out

    def _handle(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        if m := LEASES.match(path):
            return self._lease(method, m.group(1), m.group(2), body)
        if (m := PDB.match(path)) and method == "GET":
            if m.group(2) not in self.pdbs:
                return 404, status(
                    404, "NotFound", f'poddisruptionbudgets.policy "{m.group(2)}" not found'
                )
            return 200, self.pdb_object(m.group(2))
        return 404, status(404, "NotFound", "the server could not find the requested resource")

    def _lease(
        self, method: str, ns: str, name: str | None, body: Any
    ) -> tuple[int, dict[str, Any]]:
        gr = "leases.coordination.k8s.io"
        if method == "GET" and name is not None:
            if name not in self.leases:
                return 404, status(
                    404, "NotFound", f'{gr} "{name}" not found', name=name, kind="leases"
                )
            return 200, copy.deepcopy(self.leases[name])
        if method == "POST" and name is None:
            new = body["metadata"]["name"]
            if new in self.leases:
                return 409, status(
                    409, "AlreadyExists", f'{gr} "{new}" already exists', name=new, kind="leases"
                )
            obj = copy.deepcopy(body)
            obj["metadata"].update(namespace=ns, resourceVersion=self.bump(), uid=f"uid-{new}")
            obj.setdefault("apiVersion", "coordination.k8s.io/v1")
            obj.setdefault("kind", "Lease")
            self.leases[new] = obj
            self.holders.append(obj.get("spec", {}).get("holderIdentity"))
            return 201, copy.deepcopy(obj)
        if method == "PUT" and name is not None:
            if self.before_put is not None:
                self.before_put(self, name)
            if name not in self.leases:
                return 404, status(
                    404, "NotFound", f'{gr} "{name}" not found', name=name, kind="leases"
                )
            want = body.get("metadata", {}).get("resourceVersion")
            have = self.leases[name]["metadata"]["resourceVersion"]
            if want is not None and want != have:
                return 409, status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {gr} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    name=name,
                    kind="leases",
                )
            obj = copy.deepcopy(body)
            obj["metadata"].update(namespace=ns, resourceVersion=self.bump(), uid=f"uid-{name}")
            obj.setdefault("apiVersion", "coordination.k8s.io/v1")
            obj.setdefault("kind", "Lease")
            self.leases[name] = obj
            self.holders.append(obj.get("spec", {}).get("holderIdentity"))
            return 200, copy.deepcopy(obj)
        return 405, status(405, "MethodNotAllowed", f"{method} is not supported")


class _Handler(BaseHTTPRequestHandler):
    cluster: FakeCluster

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        code, out = self.cluster.handle(
            self.command, self.path, body, self.headers.get("Authorization")
        )
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def fake_apiserver(cluster: FakeCluster) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"cluster": cluster})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
