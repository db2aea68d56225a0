"""The ``aiokv`` command: demo, router, doctor, bench."""

from aiokv.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
