"""The admission gate: a memory-aware front door that holds requests instead of failing them.

A reverse proxy on its own address in front of one vLLM server (``vllm-guardian gate``), run
as a process of its own beside the guardian, whose decisions it follows by polling
``/ready/<service>``. While the guardian holds the service back (KV above the high watermark,
a drain or restart in flight, vLLM not up) new requests wait in a bounded FIFO queue instead of
reaching vLLM, and are released in order, at a bounded rate, once it admits work again; across
a restart they are sent to the new instance. See docs/gate.md.

Run from the service's ``gate:`` section of the guardian's config (``vllm-guardian gate -c
CONFIG --service NAME``, the unit ``vllm-guardian-gate@NAME.service``) or from flags.
httptools and uvloop are dependencies of the package, but nothing outside this package imports them: the
daemon reads the gate's ``GET /gate/status`` with the standard library
(``vllm_guardian/sources/gate.py``).

* ``admission.py`` — the queue, its bounds, the KV-need estimate (asyncio only);
* ``follower.py`` — opens and closes the gate from the guardian's and vLLM's answers;
* ``proxy.py`` — the pass-through, holds, retries and the gate's own error answers;
* ``body.py`` — request bodies: deadline, rate floor, the gate-wide byte budget;
* ``http1.py`` — the HTTP/1.1 server: client connections parsed by llhttp, answers written;
* ``connections.py`` — the cap on client connections, idle deadlines, malformed requests;
* ``metrics.py`` — the ``vllm_guardian_gate_*`` series;
* ``server.py`` — one gate assembled; ``cli.py`` — ``vllm-guardian gate`` (config, flags,
  sd_notify).
"""
