"""The relation registry: importing this package registers every relation by name."""

# ruff: noqa: I001 -- the import order is the registry's order: error messages list the relations
# in it, and inference proposes them in it.
from sdcscope.invariants.relations import consistent, contain, count, fields, loss, metrics, sequence  # noqa: F401

# Registered last, in the order they were added.
from sdcscope.invariants.relations import causal, gradshare, schedule  # noqa: F401
from sdcscope.invariants.relations.base import (
    RELATIONS,
    Check,
    InferConfig,
    Relation,
    View,
    register,
    validate_invariant,
)

__all__ = ["RELATIONS", "Check", "InferConfig", "Relation", "View", "register", "validate_invariant"]
