# The two commands a new user runs: `make train` and `make test`. Both set up what is missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
DEV     := $(VENV)/.dev-stamp
DIGITS  := data/digits/train_lmdb/data.mdb
# With an NVIDIA driver, the GPU extra of the CUDA major it supports (README: Install); none without one.
GPU_EXTRA := $(shell v=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1); \
                [ -n "$$v" ] && { [ "$$v" -ge 13 ] && echo cu13 || echo cu12; })
comma   := ,
# What `make train` needs: the runtime, the example's digits, and with a driver the GPU extra. The tests add
# the dev extras.
RUNTIME := .[examples$(if $(GPU_EXTRA),$(comma)$(GPU_EXTRA))]
DEVTOOLS := .[dev$(if $(GPU_EXTRA),$(comma)$(GPU_EXTRA))]
# The files whose kernels the tests check under numba's CUDA simulator, in a pytest run of their own (numba picks
# the simulator when it is first imported); a device stand-in one file activates is put back after it
# (tests/conftest.py).
SIM_TESTS := $(wildcard tests/*_sim.py)
# pytest-xdist workers for `make test`: one per core the process may run on (CI has two).
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# Train on the GPU when one is present and usable, else on the CPU.
GPU_FLAG := $(shell $(BIN)/python -c "from superneurons.backend.cuda.probe import gpu_available as g; print('--gpu 0' if g() else '')" 2>/dev/null)

.PHONY: install train test test-main test-sim lint typecheck gpu-test proto data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '$(RUNTIME)'
	touch $@

$(DEV): $(STAMP)
	$(BIN)/python -m pip install -q -e '$(DEVTOOLS)'
	touch $@

data: $(DIGITS)

$(DIGITS): | $(STAMP)
	$(BIN)/python tools/data/make_digits_lmdb.py --out data/digits

train: install data
	$(BIN)/superneurons train --solver models/lenet/lenet_solver.prototxt $(GPU_FLAG)

# ruff's rules are in pyproject.toml ([tool.ruff]).
lint: $(DEV)
	$(BIN)/ruff check superneurons tests tools

# mypy's settings and the packages it checks are in pyproject.toml ([tool.mypy]).
typecheck: $(DEV)
	$(BIN)/mypy

# After ruff, mypy and the two pytest runs go side by side (a make of their own, -j3). The main run is the
# longest, and for about a third of it its workers wait (on the package registry, on the processes its tests
# start, on each other at the end): the simulator run, at the lowest priority (nice 19), takes those idle
# cores and little else; what it has left runs once the main run is done, as it did after it. On a 2-core CI
# machine (2026-11-28) this took mypy + both runs from 830 s in sequence to 575 s. --output-sync prints each
# one's output whole as it ends; a failure of any fails `make test` once all three are done.
test: lint
	$(MAKE) --no-print-directory -j3 --output-sync=target typecheck test-main test-sim NICE="nice -n 19"

# One BLAS and OpenMP thread per test process (their children inherit it): the workers already take a core each,
# and OpenBLAS's threads spin while they wait for one. On a 2-core CI machine (2026-11-28) three LeNet-training
# test files under -n 2 took 39 s with one thread against 66 s with OpenBLAS's default two (1 min of CPU less).
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# Each worker starts on a run of consecutive tests and takes over another's when it runs dry (--dist worksteal):
# a module's fixtures are mostly set up once.
test-main: $(DEV)
	$(ONE_THREAD) $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not gpu"

# The simulator files go to the workers whole (--dist loadfile). `make test` runs it at nice 19 (NICE).
test-sim: $(DEV)
	NUMBA_ENABLE_CUDASIM=1 $(ONE_THREAD) $(NICE) $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile \
	    -p no:cacheprovider -m "simulator and not gpu" $(SIM_TESTS)

# On a GPU machine with no registry: the packages come from the machine, not a venv (docs/BENCHMARKS.md,
# "Setting up the GPU machine").
gpu-test:
	PYTHONPATH=$${PYTHONPATH:+$$PYTHONPATH:}$(CURDIR) python3 -m pytest -q -m gpu tests

# The messages and their stubs (.pyi), which give type checkers the fields the generated module builds at run time.
proto: $(DEV)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=superneurons/proto --pyi_out=superneurons/proto \
	    proto/superneurons.proto

clean:
	rm -rf data/digits snapshots
