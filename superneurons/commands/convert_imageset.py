"""`superneurons convert_imageset ROOTFOLDER/ LISTFILE DB_NAME`: images -> an LMDB or LevelDB of Datum records."""
from __future__ import annotations

import argparse
import os
import sys

from superneurons.commands._gflags import add_flag, add_switch
from superneurons.commands._options import add_command
from superneurons.data.image_list import read_image_list
from superneurons.data.imageset import ImagesetOptions, imageset_records, shuffled
from superneurons.data.databases import write_database
from superneurons.data.record_db import BACKENDS
from superneurons.errors import UserError
from superneurons.runtime.progress import bar_size, progress_wanted

EXAMPLES = """examples:
  superneurons convert_imageset -resize_height=256 -resize_width=256 -shuffle images/ train.txt train_lmdb
  superneurons convert_imageset --encoded --encode_type jpg --backend leveldb images/ val.txt val_leveldb
  superneurons convert_imageset -gray digits/ list.txt digits_lmdb

LISTFILE holds `relative/path.jpg label` lines; ROOTFOLDER is prefixed to each path as is (Caffe
writes `images/`, with the slash; one is added when missing). Keys are `%08d_<path>` in list order,
after -shuffle (a fixed seed, so the same order every time). Raw records hold BGR (or gray) uint8
pixels, as OpenCV gives Caffe; -encoded records hold the image file, re-encoded only when -gray,
a resize or another -encode_type asks for it. An image that cannot be read is reported and left
out, as Caffe does. DB_NAME is written whole or not at all (an existing one is replaced).
Caffe's spellings (-flag=value, -flag value, -noflag) and --flag both work.
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "convert_imageset", run,
                    help="convert a list of images to an LMDB or LevelDB of Datum records",
                    description="Caffe's convert_imageset: the images LISTFILE names, under ROOTFOLDER, as "
                                "Datum records in a new database for the Data layer.",
                    examples=EXAMPLES)
    p.add_argument("root", metavar="ROOTFOLDER/", help="prefix of every path in the list ('' for none)")
    p.add_argument("listfile", metavar="LISTFILE", help="`relative/path.jpg label` per line")
    p.add_argument("db_name", metavar="DB_NAME", help="the database folder to create")
    add_switch(p, "gray", "store one gray channel instead of BGR")
    add_switch(p, "shuffle", "shuffle the list (fixed seed)")
    add_flag(p, "backend", default="lmdb", type=str.lower, choices=BACKENDS, help="lmdb (default) or leveldb")
    add_flag(p, "resize_width", type=int, default=0, metavar="W", help="resize images to this width")
    add_flag(p, "resize_height", type=int, default=0, metavar="H", help="resize images to this height")
    add_switch(p, "check_size", "require every image to have the same size")
    add_switch(p, "encoded", "store the image file (encoded) instead of pixels")
    add_flag(p, "encode_type", default="", metavar="TYPE", help="png or jpg for -encoded; default: the file's own")
    return p


def run(args) -> int:
    if (args.resize_height > 0) != (args.resize_width > 0) or min(args.resize_height, args.resize_width) < 0:
        raise UserError(f"give both -resize_height and -resize_width (positive) or neither; got "
                        f"{args.resize_height} and {args.resize_width}")
    root = args.root if not args.root or args.root.endswith(os.sep) else args.root + os.sep
    options = ImagesetOptions(gray=args.gray, resize_height=args.resize_height, resize_width=args.resize_width,
                              encoded=args.encoded or bool(args.encode_type), encode_type=args.encode_type,
                              check_size=args.check_size)
    entries = read_image_list(args.listfile, "convert_imageset")
    if args.shuffle:
        entries = shuffled(entries)
    skipped: list[str] = []

    def skip(path: str, error: UserError) -> None:
        skipped.append(path)
        report(f"skipping {error}")

    bar, report, advance = _progress(len(entries))
    try:
        n = write_database(args.db_name, imageset_records(root, entries, options, skip, advance), args.backend)
    finally:
        if bar is not None:
            bar.close()
    if n == 0:
        raise UserError(f"{args.listfile}: none of the {len(entries)} images could be read; nothing written")
    note = f", skipped {len(skipped)} unreadable images" if skipped else ""
    print(f"{args.db_name}: wrote {n} records ({args.backend}){note}")
    return 0


def _progress(total: int):
    """(tqdm bar or None, print a line, count one image): a bar on a terminal, else Caffe's
    `Processed N files.` every 1000 images."""
    if progress_wanted(sys.stderr):
        from tqdm import tqdm

        bar = tqdm(total=total, unit="img", desc="convert_imageset", file=sys.stderr, **bar_size(sys.stderr))
        return bar, lambda line: tqdm.write(line, file=sys.stderr), lambda: bar.update(1)
    done = [0]

    def advance() -> None:
        done[0] += 1
        if done[0] % 1000 == 0:
            print(f"Processed {done[0]} files.", flush=True)

    return None, lambda line: print(line, file=sys.stderr), advance
