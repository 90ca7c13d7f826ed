"""Data parallelism, Caffe's way: one process per GPU (or CPU rank), each training on its own share of the
data with `batch_size` per rank, gradients averaged across ranks before every update.

- world.py: the ranks of an MPI job (mpi4py) and the host-side collectives the job needs
- devices.py: `--gpu 0,1,2,3` / `--gpu all`, checked against the machine
- launch.py: what kind of run `--gpu` asks for; the local launcher (one process per GPU via mpiexec)
- rank.py: `train` as one rank (its device, its solver, failing the whole job at once)
- solver.py: the Solver of one rank (rank 0's weights broadcast, rank 0 logs/tests/snapshots)
- reducer.py: gradient buckets, each one run of pool memory reduced by one call, started from the Net's
  `gradients_ready` hook during backward (or after it), and the time compute waited on them
- collectives.py: NCCL (nccl4py, on a backend stream) between GPUs, MPI between CPU processes

docs/PARALLEL.md is the user's page.
"""
