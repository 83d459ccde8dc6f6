"""Low I/O leaves: small pieces that touch the world and nothing of the guardian's.

Appending and atomic writes, the bounded HTTP client and server, /proc parsing, redaction,
clocks and the control socket. The standard library only, so every layer above may use them.
"""
