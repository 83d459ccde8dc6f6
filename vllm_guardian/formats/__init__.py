"""Formats: one module per file or wire format, its writer and its reader side by side.

Below the core and the edges: a format knows bytes and records, never who reads them or when.
The allocator file, the GPU state file, the ready file, vLLM's log lines, Prometheus text, the
guardian's own metric catalogue, the flight recorder's records and the incident picture.
"""
