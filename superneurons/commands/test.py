"""`superneurons test`: score a trained model, Caffe's `caffe test` (TEST-phase net, outputs averaged).

Like Caffe it logs glog lines on stderr: "Batch 0, accuracy = 0.98" per batch, then "Loss: X" and the
averaged outputs ("accuracy = 0.98"). A blob with many values prints its first few (runtime/logging.py)."""
from __future__ import annotations

import argparse

from superneurons.commands._options import (add_command, add_device_options, add_net_state_options, add_precision_option,
                                             pick_backend, split_stages)
from superneurons.errors import UserError
from superneurons.memory.pool import parse_size
from superneurons.proto import superneurons_pb2 as pb

EXAMPLES = """examples:
  superneurons test --model lenet_train_test.prototxt --weights lenet_iter_10000.caffemodel --iterations 100
  superneurons test --model M.prototxt --weights W.caffemodel --gpu 0 --gpu-memory 4G
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "test", run,
                    help="score a model: run its TEST phase and average each output",
                    examples=EXAMPLES)
    p.add_argument("--model", required=True, help="net prototxt")
    p.add_argument("--weights", help="comma-separated .caffemodel files (without: the fillers' random weights)")
    p.add_argument("--iterations", type=int, default=50, help="number of batches to score (default 50)")
    add_device_options(p)
    add_precision_option(p)
    add_net_state_options(p)
    return p


def run(args) -> int:
    from superneurons.graph.build import build_graph
    from superneurons.graph.precision import override_defaults
    from superneurons.io.caffemodel import load_weights_files
    from superneurons.io.prototxt import read_net
    from superneurons.runtime.logging import TrainLog, capped_outputs, num, score_line
    from superneurons.runtime.net import Net
    from superneurons.solver.evaluate import evaluate, score_blobs

    if args.iterations <= 0:
        raise UserError(f"--iterations must be positive, got {args.iterations}")
    log = TrainLog()
    backend = pick_backend(args.gpu)
    graph = build_graph(override_defaults(read_net(args.model), args.precision), pb.TEST, args.level, tuple(split_stages(args.stage)),
                        source=args.model)
    net = Net(graph, backend, train=False, seed=0, memory=args.memory, pool_bytes=parse_size(args.gpu_memory),
              data_workers=args.data_workers)
    if args.weights:
        for line in load_weights_files(net, args.weights):
            log.info(line)
    else:  # Caffe refuses; scoring initial weights is still useful to smoke-test a net
        log.info("No --weights given: scoring the fillers' initial weights")
    log.info(f"Running for {args.iterations} iterations.")

    def on_batch(i, outputs):
        shown, notes = capped_outputs(outputs)
        for _, name, value, _ in shown:
            log.info(f"Batch {i}, {name} = {num(value)}")
        for note in notes:
            log.info(note)

    scores, loss = evaluate(net, args.iterations, on_batch=on_batch)
    log.info(f"Loss: {num(loss)}")
    shown, notes = capped_outputs(score_blobs(scores))
    for _, name, value, weight in shown:
        log.info(score_line(name, value, weight))
    for note in notes:
        log.info(note)
    return 0
