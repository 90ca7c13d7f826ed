"""Scripts around the framework (see tools/README.md); a package so that they import each other by name."""
