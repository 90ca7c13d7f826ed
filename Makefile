# The two commands a new user runs: `make train` and `make test`. Both set up what is missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
DIGITS  := data/digits/train_lmdb/data.mdb
# With an NVIDIA driver, the GPU extra of the CUDA major it supports (README: Install); none without one.
GPU_EXTRA := $(shell v=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1); \
                [ -n "$$v" ] && { [ "$$v" -ge 13 ] && echo ,cu13 || echo ,cu12; })
# Train on the GPU when one is present and usable, else on the CPU.
GPU_FLAG := $(shell $(BIN)/python -c "from superneurons.backend.cuda.probe import gpu_available as g; print('--gpu 0' if g() else '')" 2>/dev/null)

.PHONY: install train test gpu-test proto data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev$(GPU_EXTRA)]'
	touch $@

data: $(DIGITS)

$(DIGITS): | $(STAMP)
	$(BIN)/python tools/data/make_digits_lmdb.py --out data/digits

train: install data
	$(BIN)/superneurons train --solver models/lenet/lenet_solver.prototxt $(GPU_FLAG)

test: install
	$(BIN)/python -m pytest -q -m "not gpu"

# On a GPU machine with no registry: the packages come from the machine, not a venv (docs/BENCHMARKS.md,
# "Setting up the GPU machine").
gpu-test:
	PYTHONPATH=$${PYTHONPATH:+$$PYTHONPATH:}$(CURDIR) python3 -m pytest -q -m gpu tests

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=superneurons/proto proto/superneurons.proto

clean:
	rm -rf data/digits snapshots
