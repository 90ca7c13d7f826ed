"""One log line from the backend, in glog's format as the runtime's log writes it (runtime/logging.py sits above
the backend, so the backend writes its few lines itself): `W1128 12:34:56.789012 4242 file.py:88] text`."""
from __future__ import annotations

import sys
import threading
import time


def log_line(level: str, where: str, text: str) -> None:
    """Write `text` to stderr as a glog line of `level` ("I", "W" or "E") from `where` ("file.py:line")."""
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    sys.stderr.write(f"{level}{stamp} {threading.get_native_id()} {where}] {text}\n")
