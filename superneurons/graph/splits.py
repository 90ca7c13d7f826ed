"""Automatic Split layers where one blob feeds several layers (Caffe's insert_splits, same names)."""
from __future__ import annotations

from collections import defaultdict

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb


def split_layer_name(blob: str, layer: str, top_idx: int) -> str:
    return f"{blob}_{layer}_{top_idx}_split"


def split_blob_name(blob: str, layer: str, top_idx: int, k: int) -> str:
    return f"{blob}_{layer}_{top_idx}_split_{k}"


def insert_splits(net: pb.NetParameter, where: str = "") -> pb.NetParameter:
    layers = list(net.layer)
    producer: dict[str, tuple[int, int]] = {}  # blob name -> (layer idx, top idx) of its current version
    consumers: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    bottom_src: dict[tuple[int, int], tuple[int, int]] = {}
    prefix = f"{where}: " if where else ""
    for i, layer in enumerate(layers):
        for j, blob in enumerate(layer.bottom):
            if blob not in producer:
                raise UserError(f"{prefix}layer {layer.name!r}: unknown bottom blob {blob!r} "
                                f"(bottom {j}; no earlier layer produces it)")
            src = producer[blob]
            consumers[src].append((i, j))
            bottom_src[(i, j)] = src
        for j, blob in enumerate(layer.top):
            producer[blob] = (i, j)
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    renamed: dict[tuple[int, int], str] = {}
    for src, uses in consumers.items():
        if len(uses) > 1:
            li, tj = src
            blob = layers[li].top[tj]
            for k, use in enumerate(uses):
                renamed[use] = split_blob_name(blob, layers[li].name, tj, k)
    _check_single_producer(layers, renamed, prefix)
    for i, layer in enumerate(layers):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j in range(len(layer.bottom)):
            if (i, j) in renamed:
                new.bottom[j] = renamed[(i, j)]
        for j, blob in enumerate(layer.top):
            uses = consumers.get((i, j), [])
            if len(uses) > 1:
                split = out.layer.add()
                split.name = split_layer_name(blob, layer.name, j)
                split.type = "Split"
                split.bottom.append(blob)
                split.top.extend(split_blob_name(blob, layer.name, j, k) for k in range(len(uses)))
                # A loss blob that is also consumed elsewhere keeps its weight on the first split output.
                if j < len(layer.loss_weight) and layer.loss_weight[j]:
                    split.loss_weight.append(layer.loss_weight[j])
                    split.loss_weight.extend([0.0] * (len(uses) - 1))
    return out


def _check_single_producer(layers: list[pb.LayerParameter], renamed: dict[tuple[int, int], str],
                           prefix: str) -> None:
    """Every blob has one producer or is rewritten in place (top j named as bottom j), as Caffe's Net requires.

    Caffe checks this on the net with splits inserted (AppendTop): an in-place layer on a blob that another
    layer also reads gets its bottom renamed to a split output, so its top becomes a second blob of the
    same name, and Caffe stops with "Top blob 'x' produced by multiple sources". So does this, saying why.
    """
    produced: dict[str, str] = {}
    for i, layer in enumerate(layers):
        for j, blob in enumerate(layer.top):
            in_place = j < len(layer.bottom) and layer.bottom[j] == blob
            if blob in produced and not (in_place and (i, j) not in renamed):
                why = (f"; it works in place on {blob!r}, which another layer also reads, and would overwrite that "
                       f"layer's input: give its top a new name") if in_place else ""
                raise UserError(f"{prefix}layer {layer.name!r}: top blob {blob!r} is produced by multiple sources "
                                f"(first by layer {produced[blob]!r}){why}")
            produced.setdefault(blob, layer.name)
