"""One object composing observe + detect + mitigate for a training loop, and its one step protocol."""

from sdcscope.guard.config import GuardConfig
from sdcscope.guard.engine import GuardCallback
from sdcscope.guard.guard import Guard
from sdcscope.guard.session import StepSession

__all__ = ["Guard", "GuardCallback", "GuardConfig", "StepSession"]
