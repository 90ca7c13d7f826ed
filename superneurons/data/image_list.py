"""Caffe's image list files: one `relative/path.jpg label` per line (ImageData, convert_imageset)."""
from __future__ import annotations

from superneurons.errors import UserError
from superneurons.io.prototxt import decode_text


def read_image_list(path: str, where: str) -> list[tuple[str, int]]:
    """Lines `relative/path.jpg 3`; the label is after the last space (names may contain spaces)."""
    try:
        with open(path, "rb") as f:
            lines = decode_text(f.read(), path, "an image list (`path label` lines)").splitlines()
    except FileNotFoundError:
        raise UserError(f"{where}: image list {path!r} does not exist") from None
    except OSError as e:  # a folder, unreadable
        raise UserError(f"{where}: cannot read image list {path!r} ({e.strerror or e})") from None
    entries = []
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        name, _, label = line.rpartition(" ")
        if not name or not label.lstrip("-").isdigit():
            raise UserError(f"{path}:{lineno}: expected `image_path integer_label`, got {line!r}")
        entries.append((name, int(label)))
    if not entries:
        raise UserError(f"{where}: image list {path!r} names no images")
    return entries
