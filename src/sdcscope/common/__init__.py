"""Helpers every room may import: run-directory I/O, the validation toolkit, autograd-graph and tensor helpers."""
