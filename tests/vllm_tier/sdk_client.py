"""An OpenAI SDK client with completions in flight, as a user's program would send them.

Run with the vLLM venv's Python (vLLM depends on the official ``openai`` package; the guardian's
own environment does not have it), never imported by the tests:

    python sdk_client.py BASE_URL MODEL SPEC_JSON

``SPEC_JSON``: ``{"waves": [[{"stream": true, "prompt": [ids], "max_tokens": N}, ...], ...]}``.
The first wave starts at once; each further wave when a line arrives on stdin (the test sends
it when it has done what the wave must follow). Retries are off (``max_retries=0``): a request
the server failed fails here. One JSON line on stdout per event, flushed:

* ``{"event": "ready"}`` once ``openai`` is imported and the client made;
* ``{"event": "text", "i": I}`` when request I (numbered across the waves) got its first text;
* ``{"event": "done", "i": I, "text": ..., "finish": ..., "usage": ..., "ids": [...],
  "gap_at": ..., "error": ...}`` when it ended, ``error`` the SDK's exception (None when it
  succeeded), ``gap_at`` a stream's text length at its longest wait between two chunks with
  text (where a cut stream was continued).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import openai

_out = threading.Lock()


def say(doc: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def run(client: openai.OpenAI, model: str, i: int, req: dict[str, Any]) -> None:
    text, finish, usage, ids, error = "", None, None, [], None
    gap_at, gap, last = None, 0.0, None
    args = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    try:
        if req["stream"]:
            stream = client.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
            for chunk in stream:
                if chunk.id not in ids:
                    ids.append(chunk.id)
                for c in chunk.choices:
                    if c.text and not text:
                        say({"event": "text", "i": i})
                    if c.text:
                        now = time.monotonic()
                        if last is not None and now - last > gap:
                            gap_at, gap = len(text), now - last
                        last = now
                    text += c.text
                    finish = c.finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
        else:
            answer = client.completions.create(**args)
            ids.append(answer.id)
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
            usage = answer.usage.model_dump() if answer.usage is not None else None
    except Exception as e:  # every failure is reported: it is the result
        error = f"{type(e).__name__}: {e}"[:300]
    say({"event": "done", "i": i, "text": text, "finish": finish, "usage": usage, "ids": ids,
         "gap_at": gap_at, "error": error})  # fmt: skip


def main() -> None:
    base_url, model, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600.0)
    say({"event": "ready"})  # openai imported: a later wave is sent at once when asked
    threads: list[threading.Thread] = []
    i = 0
    for n, wave in enumerate(spec["waves"]):
        if n > 0 and not sys.stdin.readline():
            break
        for req in wave:
            t = threading.Thread(target=run, args=(client, model, i, req))
            t.start()
            threads.append(t)
            i += 1
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
