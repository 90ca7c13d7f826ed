"""Seeded mutations of input files: raw bytes, prototxt text, and protobuf messages field by field.

Every function takes a `random.Random` and returns new bytes (or mutates a message in place); nothing
else is random, so a case is reproduced from its seed alone.
"""
from __future__ import annotations

import random
import re

from google.protobuf import descriptor

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 16, 255, 256, 4096, 65535, 65536, 1 << 20, 2**31 - 1, -2**31, 2**32,
                    10**9, 10**12, 2**63 - 1, -2**63, 100000]
INTERESTING_FLOATS = ["0", "-0.0", "1e-45", "0.5", "-1", "1e38", "3.5e38", "-1e38", "inf", "-inf", "nan",
                      "1e308", "2147483648"]
JUNK_STRINGS = ["", "x", "..", "data", "label", "nonexistent", "a" * 300, "caf\u00e9", "\u2603", "%s%n",
                "ReLU", "Convolution", "Data", "InnerProduct", "Split", "Input", "SoftmaxWithLoss"]
JUNK_BYTES = [b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xfe\xff", b"{", b"}", b"\"", b"#", b":", b"\n",
              b"layer {", b"\\", b"\x80\x80\x80"]


# -- raw bytes --------------------------------------------------------------------------------------
def mutate_bytes(data: bytes, rng: random.Random, rounds: int | None = None) -> bytes:
    """1-4 random edits: bit flips, interesting bytes, inserts, deletes, duplicated ranges, truncation."""
    buf = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        n = len(buf)
        op = rng.randrange(8)
        if n == 0:
            buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 0:
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            i = rng.randrange(n)
            buf[i] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01, 0xFE])
        elif op == 2:
            i = rng.randrange(n + 1)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
        elif op == 3:
            i = rng.randrange(n)
            del buf[i:i + rng.randint(1, max(1, n // 8))]
        elif op == 4:
            i = rng.randrange(n)
            j = min(n, i + rng.randint(1, 256))
            k = rng.randrange(n + 1)
            buf[k:k] = buf[i:j]
        elif op == 5:
            del buf[rng.randrange(n):]  # truncate
        elif op == 6:
            i = rng.randrange(n)
            width = rng.choice([2, 4, 8])
            buf[i:i + width] = rng.choice([b"\xff", b"\x00", b"\x7f"]) * width
        else:
            i = rng.randrange(n + 1)
            buf[i:i] = rng.choice(JUNK_BYTES)
    return bytes(buf)


# -- prototxt text ----------------------------------------------------------------------------------------
_NUMBER = re.compile(rb"(?<![\w.])-?\d+(\.\d+)?([eE][-+]?\d+)?")
_STRING = re.compile(rb'"[^"\n]*"')
_ENUM = re.compile(rb"(?<=: )[A-Z][A-Z_0-9]+\b")


def _block_spans(lines: list[bytes]) -> list[tuple[int, int]]:
    """(first, last) line indexes of each top-level `name {` ... `}` block."""
    spans, depth, start = [], 0, None
    for i, line in enumerate(lines):
        opens, closes = line.count(b"{"), line.count(b"}")
        if depth == 0 and opens > closes:
            start = i
        depth += opens - closes
        if depth <= 0 and start is not None:
            spans.append((start, i))
            start, depth = None, 0
    return spans


def mutate_text(data: bytes, rng: random.Random) -> bytes:
    """Edits a prototxt the way a typo, a bad copy or a careless edit would: numbers, names, enums, lines,
    whole blocks, stray bytes; one in ten cases is a raw byte mutation."""
    if rng.random() < 0.1:
        return mutate_bytes(data, rng)
    for _ in range(rng.randint(1, 3)):
        data = _text_edit(data, rng)
    return data


def _text_edit(data: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(9)
    if op <= 2:
        found = list(_NUMBER.finditer(data))
        if found:
            m = rng.choice(found)
            value = str(rng.choice(INTERESTING_INTS)) if rng.random() < 0.6 else rng.choice(INTERESTING_FLOATS)
            return data[:m.start()] + value.encode() + data[m.end():]
    if op == 3:
        found = list(_STRING.finditer(data))
        if found:
            m = rng.choice(found)
            other = rng.choice(found).group() if rng.random() < 0.5 else \
                b'"' + rng.choice(JUNK_STRINGS).encode() + b'"'
            return data[:m.start()] + other + data[m.end():]
    if op == 4:
        found = list(_ENUM.finditer(data))
        if found:
            m = rng.choice(found)
            other = rng.choice(found).group() if rng.random() < 0.7 else b"BOGUS"
            return data[:m.start()] + other + data[m.end():]
    lines = data.split(b"\n")
    if op == 5 and lines:
        i = rng.randrange(len(lines))
        if rng.random() < 0.5:
            del lines[i]
        else:
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
        return b"\n".join(lines)
    if op == 6:
        spans = _block_spans(lines)
        if spans:
            a, b = rng.choice(spans)
            block = lines[a:b + 1]
            if rng.random() < 0.4:
                del lines[a:b + 1]
            else:
                at = rng.choice(spans)[rng.randrange(2)] + 1
                lines[at:at] = block
            return b"\n".join(lines)
    if op == 7 and len(lines) > 1:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return b"\n".join(lines)
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.choice(JUNK_BYTES) + data[i:]


# -- protobuf messages ----------------------------------------------------------------------------------------
_INT_RANGE = {
    descriptor.FieldDescriptor.CPPTYPE_INT32: (-2**31, 2**31 - 1),
    descriptor.FieldDescriptor.CPPTYPE_INT64: (-2**63, 2**63 - 1),
    descriptor.FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


def _targets(msg, out: list, depth: int = 0) -> list:
    """(message, field) for every set field, recursing into sub-messages (repeated scalars are one target)."""
    for field, value in msg.ListFields():
        out.append((msg, field))
        if field.cpp_type == field.CPPTYPE_MESSAGE and depth < 8:
            children = value if _repeated(field) else [value]
            for child in children:
                _targets(child, out, depth + 1)
    return out


def _scalar(field, rng: random.Random):
    cpp = field.cpp_type
    if cpp in _INT_RANGE:
        lo, hi = _INT_RANGE[cpp]
        return max(lo, min(hi, rng.choice(INTERESTING_INTS)))
    if cpp in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
        return float(rng.choice(INTERESTING_FLOATS))
    if cpp == field.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if cpp == field.CPPTYPE_ENUM:
        return rng.choice(field.enum_type.values).number
    if field.type == field.TYPE_BYTES:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    return rng.choice(JUNK_STRINGS)


def _strings(targets: list) -> list[str]:
    """Every string value in the message: swapping one for another rewires a net (bottoms, tops, names)."""
    out = []
    for parent, field in targets:
        if field.type == field.TYPE_STRING:
            value = getattr(parent, field.name)
            out.extend(value if _repeated(field) else [value])
    return out


def mutate_message(msg, rng: random.Random, rounds: int | None = None) -> None:
    """Change 1-3 fields of `msg` in place: interesting values, strings swapped for others of the message
    (rewiring bottoms and tops), dropped or duplicated repeated elements, cleared sub-messages, repeated
    numbers cut short or given a NaN."""
    for _ in range(rounds or rng.randint(1, 3)):
        targets = _targets(msg, [])
        if not targets:
            return
        parent, field = rng.choice(targets)
        if field.type == field.TYPE_STRING and rng.random() < 0.6:
            value = rng.choice(_strings(targets))
            if _repeated(field):
                items = getattr(parent, field.name)
                items[rng.randrange(len(items))] = value
            else:
                setattr(parent, field.name, value)
            continue
        value = getattr(parent, field.name)
        repeated = _repeated(field)
        is_msg = field.cpp_type == field.CPPTYPE_MESSAGE
        op = rng.randrange(4)
        if op == 0 and (is_msg or repeated):
            parent.ClearField(field.name)
        elif repeated and len(value) and op == 1:
            del value[rng.randrange(len(value)):]  # cut short
        elif repeated and len(value) and op == 2:
            if is_msg:
                value.add().CopyFrom(value[rng.randrange(len(value))])
            else:
                value.append(value[rng.randrange(len(value))])
        elif repeated and len(value) and not is_msg:
            value[rng.randrange(len(value))] = _scalar(field, rng)
        elif not repeated and not is_msg:
            try:
                setattr(parent, field.name, _scalar(field, rng))
            except (ValueError, TypeError):  # a string field given bytes that are not UTF-8, say
                parent.ClearField(field.name)
