"""CUDA graphs: work recorded once (half a training pass) and replayed with a single launch.

A pass of a small-kernel net issues over a thousand launches, and the host's time to issue them (Python, the
ops' argument handling, cuLaunchKernel) can exceed the device's time to run them. Recorded as a graph, the same
work costs the host one cuGraphLaunch. Recording is stream capture: the work a function queues is recorded, not
run. Compute runs on the legacy default stream 0, which cannot be captured, so while `capture` runs, every
kernel launch (kernels/__init__.py `set_stream`), device copy, cuDNN call and cuBLAS call is pointed at a
stream of its own, and back at stream 0 afterwards; the graph is then launched on stream 0, in order with the
rest of the compute.

Capture runs in the driver's global mode: a call that could synchronize or allocate (a host read, cudaMalloc,
a copy on stream 0) fails instead of being silently left out of the graph, and `capture` raises
`CaptureFailed` with what failed. A graph replays the arrays, scalars and pointers of its capture: the caller
keeps every array in place and re-captures when a scalar changes (runtime/graph_replay.py decides when).
"""
from __future__ import annotations

from typing import Any, Callable

from cuda.bindings import driver as drv

from superneurons.backend.base import CaptureFailed
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.transfer import STREAM0, _check


class CudaGraph:
    """An instantiated graph: `launch` queues one replay on stream 0."""

    def __init__(self, graph: Any, nodes: int):
        self._graph = graph
        self._exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")  # CUDA 12's (graph, flags)
        self.nodes = nodes

    def launch(self) -> None:
        _check(drv.cuGraphLaunch(self._exec, STREAM0), "cuGraphLaunch")

    def __del__(self) -> None:
        try:
            drv.cuGraphExecDestroy(self._exec)
            drv.cuGraphDestroy(self._graph)
        except Exception:
            pass


class GraphRecorder:
    """Captures functions into CudaGraphs on a stream of its own, for one Device's handles."""

    def __init__(self, device: Any):
        self.device = device
        flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self._stream = _check(drv.cuStreamCreate(flags), "cuStreamCreate")
        self._ready = _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def capture(self, fn: Callable[[], None]) -> CudaGraph:
        """Record what `fn` queues (nothing runs); raises CaptureFailed, with every stream back on stream 0."""
        from numba import cuda

        stream = self._stream
        # The recording stream starts after what stream 0 has queued: its first reads see those writes when the
        # graph, launched on stream 0 later, replays them (the wait itself is not part of the graph).
        _check(drv.cuEventRecord(self._ready, STREAM0), "cuEventRecord")
        _check(drv.cuStreamWaitEvent(stream, self._ready, 0), "cuStreamWaitEvent")
        _check(drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
               "cuStreamBeginCapture")
        self._point_at(int(stream))
        failure: BaseException | None = None
        try:
            with cuda.defer_cleanup():  # numba's deferred frees are cuMemFree calls, refused during a capture
                fn()
        except Exception as e:  # any refused call: the capture is void, the caller runs the pass eagerly
            failure = e
        finally:
            self._point_at(0)
            err, graph = drv.cuStreamEndCapture(stream)
        if failure is not None or err != drv.CUresult.CUDA_SUCCESS:
            if err == drv.CUresult.CUDA_SUCCESS and graph is not None:
                drv.cuGraphDestroy(graph)
            reason = f"{type(failure).__name__}: {failure}" if failure is not None else f"cuStreamEndCapture: {err!r}"
            raise CaptureFailed(reason.splitlines()[0])
        try:
            _err, _nodes, count = drv.cuGraphGetNodes(graph, 0)
            return CudaGraph(graph, int(count))
        except Exception as e:  # recorded, but not instantiable
            drv.cuGraphDestroy(graph)
            raise CaptureFailed(f"instantiating the graph: {e}") from None

    def _point_at(self, stream: int) -> None:
        K.set_stream(stream or None)
        self.device.cudnn.set_stream(stream)
        self.device.cublas.set_stream(stream)
