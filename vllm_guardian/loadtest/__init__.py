"""``vllm-guardian loadtest``: a synthetic peak against a vLLM server, watched by the guardian's
own sources, stopped before harm, with a verdict and the flags to set (docs/loadtest.md).

``profile`` (load shape, limits, the prompts file, the URL guard) → ``runner`` (the load and the
watching, the shell) → ``results`` (a step's figures) → ``recommend`` (pure: verdict and flags)
→ ``report`` (text, JSON, chart, live line); ``cli`` ties them together.
"""
