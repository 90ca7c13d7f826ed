#!/usr/bin/env bash
# Rebuild tests/fixtures/caffe/ with Caffe itself: build Caffe's command-line tools (CPU only), train the
# repository's LeNet on the digits LMDB, and have Caffe score it, dump per-image probabilities and resume
# training from its own .solverstate. Nothing from Caffe's source lands in the repository; only files that
# the Caffe binaries wrote (and compact NumPy packs of them) do.
#
# Needs: Debian bookworm (or close) as root, the package registries (apt, PyPI), and the repo's .venv
# (`make install`). About 10 minutes on 2 cores, most of it compiling libcaffe.
#
#   tools/caffe_reference/make_fixture.sh            # from the repository root
#
# Caffe source: the PyPI sdist brocolli-caffe 9.0.2 (sha256 below). Its metadata says "official caffe, commit
# 9b891540183ddc834a02b2bd81b31afae71b2153", but the tree is a derivative: its Makefile reports version
# 1.0.0-rc3, its Data layer still reads through DataReader (pre-1.0), and it adds SSD's layers (AnnotatedData,
# MultiBoxLoss, ...), a few more (ReLU6, HardSwish, ...) and PoolingParameter.ceil_mode (default true, i.e.
# BVLC's rounding). The layers LeNet uses (Data, Convolution, Pooling MAX, InnerProduct, ReLU, Softmax,
# SoftmaxWithLoss, Accuracy) and the SGD solver follow BVLC Caffe; see docs/CAFFE_COMPAT.md.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=/tmp/caffe_build                  # outside the repository
WORK=/tmp/caffe_fixture                 # the fixture prototxts name this folder (snapshot_prefix)
FIXTURE=$REPO/tests/fixtures/caffe
PKG=brocolli-caffe-9.0.2
PKG_SHA256=c6410cc60bdd6db685d441b66be7df05410f8850ac88d6b75d48ef9b2315c08a
SRC=$BUILD/$PKG
PY=$REPO/.venv/bin/python

# --- 1. build dependencies (Debian bookworm package names) -------------------------------------------------
if [ "${SKIP_APT:-0}" != 1 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    g++ make libboost-system-dev libboost-thread-dev libboost-filesystem-dev libboost-regex-dev \
    libprotobuf-dev protobuf-compiler libgoogle-glog-dev libgflags-dev libhdf5-dev libopenblas-dev liblmdb-dev
fi

# --- 2. Caffe's source, from PyPI ----------------------------------------------------------------------------
mkdir -p "$BUILD"
TARBALL=$BUILD/$PKG.tar.gz
if [ ! -f "$TARBALL" ]; then
  if [ -f /tmp/cm/$PKG.tar.gz ]; then cp /tmp/cm/$PKG.tar.gz "$TARBALL"
  else "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation -d "$BUILD" brocolli-caffe==9.0.2
  fi
fi
echo "$PKG_SHA256  $TARBALL" | sha256sum -c -
[ -d "$SRC" ] || tar xzf "$TARBALL" -C "$BUILD"

# --- 3. configure and build (Caffe's own Makefile) ------------------------------------------------------------
# The sdist's CMakeLists.txt has the libcaffe and tools targets commented out (it only builds pycaffe for
# conda), so the build uses Caffe's Makefile with this Makefile.config: CPU only, no OpenCV (OpenCV 4 breaks
# old Caffe), LMDB yes, LevelDB no, OpenBLAS, no Python/Matlab.
cat > "$SRC/Makefile.config" <<'EOF'
CPU_ONLY := 1
USE_CUDNN := 0
USE_OPENCV := 0
USE_LEVELDB := 0
USE_LMDB := 1
BLAS := open
INCLUDE_DIRS := /usr/include/hdf5/serial
LIBRARY_DIRS := /usr/lib/x86_64-linux-gnu/hdf5/serial /usr/lib/x86_64-linux-gnu
CUSTOM_CXX := g++ -std=c++14
BUILD_DIR := build
DISTRIBUTE_DIR := distribute
Q ?= @
EOF
# Source patches: none. This tree already calls protobuf's one-argument SetTotalBytesLimit (src/caffe/util/
# io.cpp) and compiles unchanged against bookworm's protobuf 3.21, boost 1.74, glog 0.6 and gcc 12 with
# -std=c++14. (Were a patch needed, its sed command would go here.)
# The Makefile forces BUILD_DIR=temp, so the binaries land in .temp_release/.
BIN=$SRC/.temp_release/tools
(cd "$SRC" && make -j2 .temp_release/tools/caffe.bin .temp_release/tools/extract_features.bin)
CAFFE=$BIN/caffe.bin
EXTRACT=$BIN/extract_features.bin
"$CAFFE" --version

# --- 4. the data and the runs (from the repository root: the prototxts' LMDB paths are relative to it) -------
cd "$REPO"
export GLOG_logtostderr=1              # Caffe's whole log on stderr (into the .log files), none in /tmp
"$PY" tools/data/make_digits_lmdb.py --out data/digits
rm -rf "$WORK" && mkdir -p "$WORK/resume"

# Train 400 iterations (the repo's LeNet solver with solver_mode CPU, max_iter 400, a snapshot at 400).
"$CAFFE" train --solver="$FIXTURE/lenet_solver_cpu.prototxt" 2>&1 | tee "$WORK/caffe_train.log"
# Score it on the 300 test digits (3 batches of 100).
"$CAFFE" test --model="$FIXTURE/lenet_train_test.prototxt" --weights="$WORK/lenet_iter_400.caffemodel" \
  --iterations=3 2>&1 | tee "$WORK/caffe_test.log"
# Dump per-image data/label/ip2/prob and per-batch loss/accuracy of the same 3 TEST batches.
"$EXTRACT" "$WORK/lenet_iter_400.caffemodel" "$FIXTURE/lenet_extract.prototxt" \
  data,label,ip2,prob,loss,accuracy \
  "$WORK/feat_data,$WORK/feat_label,$WORK/feat_ip2,$WORK/feat_prob,$WORK/feat_loss,$WORK/feat_accuracy" \
  3 lmdb CPU 2>&1 | tee "$WORK/caffe_extract.log"
# Resume from Caffe's own .solverstate for 20 more iterations (display 1: every iteration's loss).
"$CAFFE" train --solver="$FIXTURE/lenet_solver_resume.prototxt" \
  --snapshot="$WORK/lenet_iter_400.solverstate" 2>&1 | tee "$WORK/caffe_resume.log"

# --- 5. the fixture --------------------------------------------------------------------------------------------
"$PY" tools/caffe_reference/pack_fixture.py --features "$WORK" --test-lmdb data/digits/test_lmdb \
  --out "$FIXTURE/caffe_lenet_outputs.npz" \
  --resume-log "$WORK/caffe_resume.log" --resume-model "$WORK/resume/lenet_iter_420.caffemodel" \
  --resume-state "$WORK/resume/lenet_iter_420.solverstate" --resume-out "$FIXTURE/caffe_lenet_resume.npz" \
  --train-lmdb data/digits/train_lmdb --train-batch 64
cp "$WORK/lenet_iter_400.caffemodel" "$WORK/lenet_iter_400.solverstate" "$FIXTURE/"
for log in caffe_train caffe_test caffe_resume; do cp "$WORK/$log.log" "$FIXTURE/$log.log"; done
{
  echo "package: $PKG (PyPI sdist), sha256 $PKG_SHA256"
  echo "package metadata: official caffe, commit id 9b891540183ddc834a02b2bd81b31afae71b2153"
  echo "built version: $("$CAFFE" --version 2>&1 | tail -1)"
  echo "build: Caffe Makefile, CPU_ONLY, no OpenCV, LMDB, OpenBLAS $(dpkg-query -W -f='${Version}' libopenblas0-pthread 2>/dev/null || true), protobuf $(dpkg-query -W -f='${Version}' libprotobuf-dev), gcc $(g++ -dumpfullversion)"
  echo "source patches: none"
  echo "made by: tools/caffe_reference/make_fixture.sh"
} > "$FIXTURE/CAFFE_VERSION.txt"
du -ch "$FIXTURE"/* | tail -1
