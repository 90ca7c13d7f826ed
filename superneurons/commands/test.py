"""`superneurons test`: score a trained model, Caffe's `caffe test` (TEST-phase net, outputs averaged)."""
from __future__ import annotations

import argparse

from superneurons.commands._options import add_device_options, parse_size
from superneurons.commands.train import pick_backend
from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb

EXAMPLES = """examples:
  superneurons test --model lenet_train_test.prototxt --weights lenet_iter_10000.caffemodel --iterations 100
  superneurons test --model M.prototxt --weights W.caffemodel --gpu 0 --gpu-memory 4G
"""


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("test", help="score a model: run its TEST phase and average each output",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="net prototxt")
    p.add_argument("--weights", help="comma-separated .caffemodel files (without: the fillers' random weights)")
    p.add_argument("--iterations", type=int, default=50, help="number of batches to score (default 50)")
    add_device_options(p)
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--stage", action="append", default=[])
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from superneurons.graph.build import build_graph
    from superneurons.io.caffemodel import load_weights_files
    from superneurons.io.prototxt import read_net
    from superneurons.runtime.logging import num, score_line
    from superneurons.runtime.net import Net
    from superneurons.solver.evaluate import evaluate

    if args.iterations <= 0:
        raise UserError(f"--iterations must be positive, got {args.iterations}")
    backend = pick_backend(args.gpu)
    graph = build_graph(read_net(args.model), pb.TEST, args.level, tuple(args.stage), source=args.model)
    net = Net(graph, backend, train=False, seed=0, memory=args.memory, pool_bytes=parse_size(args.gpu_memory))
    if args.weights:
        for line in load_weights_files(net, args.weights):
            print(line)
    else:  # Caffe refuses; scoring initial weights is still useful to smoke-test a net
        print("No --weights given: scoring the fillers' initial weights")
    print(f"Running for {args.iterations} iterations.")

    def on_batch(i, outputs):
        for name, values, _ in outputs:
            for v in values:
                print(f"Batch {i}, {name} = {num(v)}")

    scores, loss = evaluate(net, args.iterations, on_batch=on_batch)
    print(f"Loss: {num(loss)}")
    for s in scores:
        print(score_line(s.name, s.value, s.loss_weight))
    return 0
