"""Turn the JSON files of the tools/bench scripts into the Markdown for docs/BENCHMARKS.md.

    python3 -m tools.bench.report [--in DIR] [--out FILE]

Reads every <benchmark>[_quick].json in DIR (default $OUT or .) that a bench script wrote and prints, per
benchmark: the device and versions, the exact command, its tables and its targets (met, or missed
by how much). Paste the sections into docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tools.bench import common

ORDER = ("speed_zoo", "wider", "deeper", "pool", "cache", "workspace", "memory_trace")


def load(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("benchmark") in ORDER:
            doc["_file"] = path.name
            docs.append(doc)
    return sorted(docs, key=lambda d: (ORDER.index(d["benchmark"]), d.get("quick", False)))


def versions_line(doc: dict) -> str:
    dev = doc.get("device", {})
    v = doc.get("versions", {})
    parts = [f"{k} {v[k]}" for k in ("python", "numpy", "numba", "numba-cuda", "cuda-bindings", "nvidia-cudnn-cu13",
                                     "nvidia-cudnn-cu12", "torch", "torchvision") if k in v]
    where = dev.get("name", "?") + (f" ({dev['memory']}, driver {dev['driver']})" if dev.get("memory") else "")
    return f"Measured {doc.get('date', '?')} on **{where}**; " + ", ".join(parts) + "."


def target_line(t: dict) -> str:
    if t.get("measured") is None:
        return f"- {t['name']}: {t['target']}: not measured" + (f" ({t['note']})" if t.get("note") else "")
    state = "met" if t["met"] else f"**missed** by {common.fmt(t['shortfall'])}"
    return (f"- {t['name']}: {t['target']}: {common.fmt(t['measured'])} ({state})"
            + (f"; {t['note']}" if t.get("note") else ""))


def section(doc: dict) -> str:
    lines = [f"### {doc['title']}" + (" (quick)" if doc.get("quick") else ""), "", versions_line(doc), "",
             "```", f"python3 {doc['command']}", "```", ""]
    env = doc.get("env") or {}
    if env:
        lines += [f"Environment: {', '.join(f'{k}={v}' for k, v in sorted(env.items()))}.", ""]
    for t in doc.get("tables", []):
        if t is not doc["tables"][0]:
            lines += [f"{t['title']}:", ""]
        lines += [common.markdown_table(t["header"], t["rows"]), ""]
    if doc.get("targets"):
        lines += ["Targets:", ""] + [target_line(t) for t in doc["targets"]] + [""]
    lines += [f"- {n}" for n in doc.get("notes", [])]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="folder", default=os.environ.get("OUT", "."))
    ap.add_argument("--out", help="write the Markdown here instead of stdout")
    args = ap.parse_args(argv)
    docs = load(Path(args.folder))
    if not docs:
        print(f"no benchmark JSON in {args.folder}", file=sys.stderr)
        return 1
    text = "\n".join(section(d) for d in docs)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
