"""Actuators: the edge that acts (gate, systemd, flags file, notify sinks). They never raise into the loop."""
