"""One module per command; each defines `register(subparsers) -> ArgumentParser` and sets `func`;
modules starting with an underscore hold what several commands share."""
