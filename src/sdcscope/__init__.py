"""sdcscope: silent data corruption in PyTorch LLM training.

Importing the package is cheap; torch-heavy parts are imported lazily.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
