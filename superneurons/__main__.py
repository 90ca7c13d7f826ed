try:
    from superneurons.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python is still importing: one line, no traceback
    import sys

    print("superneurons: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
