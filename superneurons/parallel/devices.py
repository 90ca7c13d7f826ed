"""`--gpu 0,1,2,3` / `--gpu all`: which GPUs a training uses, checked against the machine."""
from __future__ import annotations

from superneurons.errors import UserError


def gpu_count() -> int:
    from superneurons.backend import device_count

    return device_count()


def parse_gpus(text: str, available: int | None = None) -> list[int]:
    """The device ids `text` names, in order. `available`: how many GPUs the machine has (None: ask the
    driver). One line naming the numbers for an id that does not exist, a repeated id, or `all` on a
    machine with none."""
    spec = str(text).strip()
    count = gpu_count() if available is None else available
    if count == 0:
        raise UserError(f"--gpu {spec}: this machine has no usable NVIDIA GPU; drop --gpu to train on the CPU")
    if spec.lower() == "all":
        return list(range(count))
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            device = int(part)
        except ValueError:
            raise UserError(f"--gpu {spec!r}: {part!r} is not a device number; give ids like 0,1,2,3 or all") \
                from None
        if device in ids:
            raise UserError(f"--gpu {spec!r}: GPU {device} is listed twice; each GPU runs one process")
        if not 0 <= device < count:
            raise UserError(f"--gpu {spec!r}: there is no GPU {device}; this machine has {count} GPU(s), "
                            f"numbered 0..{count - 1}")
        ids.append(device)
    return ids
