"""Container mode of ``run``: what the guardian does differently as a pod's entrypoint.

Where it sits: read once when the healing layer is built (``healing.py``), from the
environment the Helm chart sets (charts/vllm-guardian/templates/deployment.yaml):

* ``VLLM_GUARDIAN_CONTAINER=1``: the supervised vLLM's output goes to the guardian's stdout as
  well as to the followed log file, so ``kubectl logs`` shows vLLM;
* ``VLLM_GUARDIAN_POD_NAME``, ``_POD_NAMESPACE``, ``_POD_UID``, ``_NODE_NAME`` (the downward
  API): the pod's identity, written into every audit record so a fleet's records say which
  replica decided what.

* a changed config file (a ConfigMap update) is reloaded as SIGHUP reloads it (``ConfigWatch``,
  polled once a tick by the daemon).

The mode and the identity are pure functions of the environment mapping given; no
import-time reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_IDENTITY = {
    "pod": "VLLM_GUARDIAN_POD_NAME",
    "namespace": "VLLM_GUARDIAN_POD_NAMESPACE",
    "pod_uid": "VLLM_GUARDIAN_POD_UID",
    "node": "VLLM_GUARDIAN_NODE_NAME",
}


def container_mode(environ: Mapping[str, str]) -> bool:
    return environ.get("VLLM_GUARDIAN_CONTAINER", "") in ("1", "true", "yes")


def pod_identity(environ: Mapping[str, str]) -> dict[str, str]:
    """The pod's identity from the downward API; empty outside a pod."""
    return {key: environ[var] for key, var in _IDENTITY.items() if environ.get(var)}


class ConfigWatch:
    """A mounted ConfigMap changes under the guardian (the kubelet swaps a symlink): reload
    then, as on SIGHUP. Compares what ``stat`` says of the file (following links) each tick;
    a file that cannot be read now is "unchanged" (the reload would refuse it anyway)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = self._stat()

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def changed(self) -> bool:
        now = self._stat()
        if now is None or now == self._seen:
            return False
        self._seen = now
        return True
