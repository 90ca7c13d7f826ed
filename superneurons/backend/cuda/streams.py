"""Streams beside stream 0 and the events that order them (the Backend's `make_stream`, `compute_waits`,
`compute_event`), for work that overlaps compute: the data-parallel gradient reduction queues NCCL calls on
such a stream.

Compute runs on the legacy default stream 0 (transfer.py says why); a stream made here is NON_BLOCKING, so
nothing orders it against stream 0 but the events: `follow_compute` records a marker on stream 0 that the
stream waits for (one marker serves every call: cuStreamWaitEvent waits for its latest record), and
`compute_waits` makes stream 0 wait for an event of the stream, on the device.
"""
from __future__ import annotations

from typing import Any

from cuda.bindings import driver as drv

from superneurons.backend.cuda.transfer import STREAM0, CudaEvent, _check


class TimedEvent(CudaEvent):
    """An event with timing on, recorded on `stream`."""

    __slots__ = ()

    def __init__(self, stream: Any):
        self.handle = _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        _check(drv.cuEventRecord(self.handle, stream), "cuEventRecord")

    def elapsed_ms(self, start: "TimedEvent") -> float:
        return float(_check(drv.cuEventElapsedTime(start.handle, self.handle), "cuEventElapsedTime"))


class CudaStream:
    def __init__(self, high_priority: bool = False) -> None:
        # Stream 0 has the default priority, the least; a high-priority stream's blocks are started first
        # whenever both have blocks waiting for a multiprocessor (running blocks are not preempted).
        least, greatest = _check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.stream = _check(drv.cuStreamCreateWithPriority(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                                            greatest if high_priority else least),
                             "cuStreamCreateWithPriority")
        self.high_priority = high_priority
        self.handle = int(self.stream)
        self._marker = _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def follow_compute(self) -> None:
        _check(drv.cuEventRecord(self._marker, STREAM0), "cuEventRecord")
        _check(drv.cuStreamWaitEvent(self.stream, self._marker, 0), "cuStreamWaitEvent")

    def record(self) -> CudaEvent:
        return CudaEvent(self.stream)

    def synchronize(self) -> None:
        _check(drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


def compute_waits(event: CudaEvent) -> None:
    _check(drv.cuStreamWaitEvent(STREAM0, event.handle, 0), "cuStreamWaitEvent")


def compute_event() -> TimedEvent:
    return TimedEvent(STREAM0)
