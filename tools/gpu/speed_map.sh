#!/usr/bin/env bash
# On a 4-GPU machine, one call: the whole speed table of the zoo, ours in both layouts and both precisions
# beside PyTorch's configurations, one job per GPU side by side (tools/gpu/per_gpu.sh; logs and each job's
# speed_zoo.json come back in $OUT/per_gpu_logs.tgz):
#   GPU 0: ours with SUPERNEURONS_LAYOUT=nchw in fp32 and bf16, then tests/test_cuda_channels_last.py
#   GPU 1: ours with SUPERNEURONS_LAYOUT=nhwc in fp32 and bf16
#   GPU 2: PyTorch eager fp32 NCHW and fp32 channels_last
#   GPU 3: PyTorch bf16 autocast channels_last, then torch.compile of it on $COMPILE_NETS (half the limit each:
#          the nine nets in bf16-cl took 145 s; compiling ResNet-50 took 49 s, VGG16 19 s, Inception-v4 over 77 s)
# MAP_NETS (default: the nine zoo nets), MAP_LIMIT (seconds each job may start nets, default 340: the
# nine nets in one layout took about 300 s on an H200, and the call must end within 600).
#   bash tools/gpu/speed_map.sh
set -u
NETS=${MAP_NETS:-alexnet,vgg16,resnet50,resnet101,resnet152,inception_v4,densenet121,mobilenet,squeezenet}
COMPILE_NETS=${COMPILE_NETS:-resnet50,vgg16,inception_v4}
LIMIT=${MAP_LIMIT:-340}
COMMON="--nets $NETS --iterations 10 --warmup 3 --timeout 150 --out \$OUT"
ZOO="python -m tools.bench.speed_zoo"
bash tools/gpu/per_gpu.sh \
    "SUPERNEURONS_LAYOUT=nchw $ZOO $COMMON --no-torch --precisions fp32,bf16 --time-limit $LIMIT --tag nchw > \$OUT/nchw.log 2>&1; tail -2 \$OUT/nchw.log; timeout 130 python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_cuda_channels_last.py > \$OUT/tests.log 2>&1; tail -1 \$OUT/tests.log" \
    "SUPERNEURONS_LAYOUT=nhwc $ZOO $COMMON --no-torch --precisions fp32,bf16 --time-limit $LIMIT --tag nhwc > \$OUT/nhwc.log 2>&1; tail -2 \$OUT/nhwc.log" \
    "$ZOO $COMMON --no-ours --no-torchvision --torch-configs fp32,fp32-cl --time-limit $LIMIT --tag torch_fp32 > \$OUT/torch_fp32.log 2>&1; tail -2 \$OUT/torch_fp32.log" \
    "$ZOO $COMMON --no-ours --no-torchvision --torch-configs bf16-cl --time-limit $((LIMIT / 2)) --tag torch_bf16 > \$OUT/torch_bf16.log 2>&1; tail -2 \$OUT/torch_bf16.log; $ZOO --nets $COMPILE_NETS --iterations 10 --warmup 3 --timeout 240 --out \$OUT --no-ours --no-torchvision --torch-configs bf16-cl-compile --time-limit $((LIMIT / 2)) --tag torch_compile > \$OUT/torch_compile.log 2>&1; tail -2 \$OUT/torch_compile.log"
