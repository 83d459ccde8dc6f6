"""Actuators: the edge that acts (gate, systemd, flags file, notify sinks).

They never raise into the loop; they return results that the next tick observes.
"""
