"""Generators of model definitions under models/ (see tools/README.md)."""
