"""One object composing observe + detect + mitigate for any training loop."""

from sdcscope.guard.config import GuardConfig
from sdcscope.guard.guard import Guard, GuardCallback

__all__ = ["Guard", "GuardCallback", "GuardConfig"]
