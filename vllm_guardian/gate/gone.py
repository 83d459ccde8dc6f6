"""The client left: the exception the gate's server raises where a request's client closed its
connection before its body was all read (or before "100 Continue" could be sent), and the
proxy catches.

A module of its own because it subclasses ``ConnectionResetError`` (so code that catches that
catches it), and mypyc compiles no subclass of a built-in exception but ``Exception``'s: the
server's module (``http1.py``) is one the compiled build compiles (``gate/compiled.py``).
"""

from __future__ import annotations


class ClientGone(ConnectionResetError):
    """The client closed its connection before its request's body was all read (or before
    "100 Continue" could be sent)."""
