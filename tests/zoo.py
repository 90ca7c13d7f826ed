"""Where the tests find the Caffe model zoo: the folder named by SUPERNEURONS_ZOO.

The zoo is not part of the repository: it is a folder of Caffe's own files laid out as `caffe/models/bvlc_alexnet/
deploy.prototxt`, `caffe-v1-format/models/...` (from Caffe's repository and its model zoo). Without the variable,
or with a file missing from it, the tests that need it skip and say what is missing.
"""
from __future__ import annotations

from pathlib import Path

from superneurons import settings

ZOO_ENV = "SUPERNEURONS_ZOO"  # declared in superneurons/settings.py
ZOO: Path | None = Path(settings.get(ZOO_ENV)).expanduser() if settings.get(ZOO_ENV) else None


def zoo_path(rel: str = "") -> Path:
    """`rel` inside the zoo (a path that does not exist when the zoo is not set)."""
    return (ZOO if ZOO is not None else Path(f"${ZOO_ENV}")) / rel


def missing(rel: str = "") -> str | None:
    """Why a test needing `rel` (or the zoo itself) cannot run here, or None when it can."""
    if ZOO is None:
        return f"the Caffe model zoo is not configured: set {ZOO_ENV} to the folder holding caffe/models/..."
    if not zoo_path(rel).exists():
        return f"{zoo_path(rel)} does not exist (the zoo in {ZOO_ENV}={ZOO} lacks it)"
    return None
