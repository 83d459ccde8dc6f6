"""Command-line tools: ``vllm-guardian`` and its subcommands (operator, demo, replay, install).

The top of the package: a tool may use any layer; nothing below imports a tool.
"""
