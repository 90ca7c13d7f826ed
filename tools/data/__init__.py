"""Builders of datasets and converters of images into databases (see tools/README.md)."""
