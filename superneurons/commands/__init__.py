"""One module per command; each defines `register(subparsers) -> ArgumentParser` and sets `func`."""
