"""sdcscope: silent data corruption in PyTorch LLM training.

Importing the package is cheap; torch-heavy parts are imported lazily. The library logs through
the ``sdcscope`` logger tree (``logging.getLogger("sdcscope")``; a guard's detection is one
WARNING line) and prints nothing; an application configures the handlers (the CLI does).
"""

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]
