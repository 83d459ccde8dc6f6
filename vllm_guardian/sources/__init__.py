"""Sources: the edge that observes. One module per source, each with one Collector class and
pure ``parse_*`` functions; :mod:`vllm_guardian.sources.registry` lists them.

A collector never raises into the tick: whatever goes wrong becomes a :class:`Reading` with
``payload=None`` and an error and hint a person can act on.
"""
