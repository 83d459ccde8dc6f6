"""The daemon's shell: what runs the tick and talks to the world around it.

The daemon reads the sources, asks the core, hands decisions to healing (which drives the
actuators and saves state) and exposition (``/metrics``); container mode and the instance lock
sit beside it.
"""
