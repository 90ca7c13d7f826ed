"""Reading glog lines in tests: `I1124 03:15:49.123456 12345 solver.py:160] message`."""
from __future__ import annotations

import re

# glog's header: severity, MMDD, HH:MM:SS.microseconds, thread id (right-aligned in 5), file:line]
GLOG = re.compile(r"([IWEF])(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) +(\d+) ([^ :\]]+):(\d+)\] (.*)")


def messages(text: str) -> list[str]:
    """The messages of the glog lines in `text` (other lines, e.g. a progress bar's, are left out)."""
    return [m.group(11) for m in map(GLOG.fullmatch, text.splitlines()) if m]
