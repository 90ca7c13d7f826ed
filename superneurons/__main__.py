try:
    from superneurons.cli import run

    run()  # exits; every Ctrl-C from its first step on is its to answer
except KeyboardInterrupt:  # Ctrl-C while Python is still importing, or before run's first step
    import _signal  # behind `signal`, loaded with Python: importing it runs no Python code a second Ctrl-C could stop
    import sys

    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # first: the line and the exit are not cut short by another
    print("superneurons: interrupted", file=sys.stderr)
    exec("")  # see cli.forget_unhandled_interrupt (not imported: it may be what the Ctrl-C cut short)
    raise SystemExit(130) from None
