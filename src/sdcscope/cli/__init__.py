"""The ``sdcscope`` command. torch is imported inside commands only, so ``--help`` stays fast."""

from sdcscope.cli.app import app, main

__all__ = ["app", "main"]
