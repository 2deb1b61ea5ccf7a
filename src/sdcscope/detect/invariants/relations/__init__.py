"""The relation registry: importing this package registers every relation by name."""

from sdcscope.detect.invariants.relations import (  # noqa: F401
    consistent, contain, count, fields, loss, metrics, sequence,
)
# Registered last, in the order they were added: error messages list the relations in the
# registry's order, and inference proposes them in it.
from sdcscope.detect.invariants.relations import causal, gradshare  # noqa: F401
from sdcscope.detect.invariants.relations.base import (
    RELATIONS, Check, InferConfig, Relation, View, register, validate_invariant,
)

__all__ = ["RELATIONS", "Check", "InferConfig", "Relation", "View", "register", "validate_invariant"]
