"""Parameters streamed from the host, step by step: what each step brings in, prefetches and sends home.

When the memory manager streams parameters (`memory/params.py`: `OffloadedParams`), a step's parameter
tensors come to the device just before it and go home after it: a forward step sends home only what it
changed (BatchNorm's running statistics), a backward step the gradients it accumulated. The next step's
tensors are prefetched while a step computes. A test net streams the train net's parameters through the
train net's store, so a Net may read from two stores.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class ParamStreaming:
    """Per forward and backward step, for every store streaming parameters: (store, tensors the step uses,
    tensors it changes)."""

    def __init__(self, stores: list[Any], graph: Any, train: bool, backward_steps: list[Any]):
        self.stores = stores
        per_store = [s.step_lists(graph, train) for s in stores]
        self.forward = [[(s, *f[i]) for s, (f, _b) in zip(stores, per_store) if f[i][0]]
                        for i in range(len(graph.nodes))]
        index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.backward = [[(s, *b[index[id(st.node)]]) for s, (_f, b) in zip(stores, per_store)
                          if b[index[id(st.node)]][0]] for st in backward_steps]

    @staticmethod
    def bring_in(steps: list[list], i: int, prefetch_next: bool = True) -> None:
        """Before step `i` of `steps` (self.forward or self.backward): its tensors on the device, and the next
        step's copies queued before this step's kernels, so they overlap them."""
        for store, tensors, _changed in steps[i]:
            store.acquire(tensors)
        if prefetch_next and i + 1 < len(steps):
            for store, tensors, _changed in steps[i + 1]:
                store.prefetch(tensors)

    @staticmethod
    def send_home(steps: list[list], i: int, changed: bool = True) -> None:
        """After step `i`: what it changed goes home (`changed` False: nothing did, a replayed forward), the
        rest is dropped."""
        for store, tensors, step_changed in steps[i]:
            store.release(tensors, step_changed if changed else ())

    def settle(self) -> None:
        """Wait for the copies home still in flight, so host code may read the homes."""
        for store in self.stores:
            store.settle()


class HostAwareBackend:
    """The Net's backend, for code that reads or writes parameters between steps (weight files, snapshots,
    `net.backend.to_host(decl.data)`). A streamed parameter then lives in its host home (a NumPy array,
    pinned on the GPU), which the device backend's to_host/from_host need not accept: such arrays are read
    and written here directly, once the copies into them have landed. Everything else is the backend's."""

    def __init__(self, backend: Any, net: Any):
        self._backend = backend
        self._net = net

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @property
    def raw(self) -> Any:
        """The device backend itself."""
        return self._backend

    def _home_of(self, array: Any):
        for store in self._net.param_stores():
            key = store.home_key(array)
            if key is not None:
                store.settle()
                return store, key
        return None

    def to_host(self, src: Any) -> np.ndarray:
        if self._home_of(src) is not None:
            return np.array(src, copy=True)
        return self._backend.to_host(src)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        home = self._home_of(dst)
        if home is None:
            self._backend.from_host(dst, src)
            return
        store, key = home
        store.write(store.by_key[key], src)
