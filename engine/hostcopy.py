"""Copies of pool rows into host memory: what swapping, checkpoints and CPU-staged exports send.

On a CPU device the rows already are host memory and nothing is copied. From a GPU the copy goes
into page-locked memory, so it runs at the link's speed and the way back
(``.to(device, non_blocking=True)``) is asynchronous too. A swap-out does not wait for its copy:
it runs on a side stream, beside the steps that follow (the forward keeps the compute units, the
copy engine moves the bytes), and the host goes on scheduling. Ordering, on the GPU only:

- the side stream first waits for the work queued so far, which produced the rows;
- the rows' memory is marked in use by the side stream (``record_stream``), so the allocator does
  not hand it to the next step while the copy reads it;
- the page-locked buffer is not reused before the copy ends (torch's host allocator records the
  copy's event on it);
- whatever reads a swapped copy back onto the GPU first makes the main stream wait for the side
  stream (``fence``); whatever reads it on the host waits for the copy itself (``wait=True``).
"""
from __future__ import annotations

import torch


class HostCopier:
    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending = 0            # asynchronous copies queued since the last fence

    def to_host(self, t: torch.Tensor, wait: bool = True) -> torch.Tensor:
        """A host copy of t. ``wait=False`` (GPU): the copy is queued on the side stream and the
        returned tensor is filled when it ends; read it on the GPU after ``fence``."""
        if self.side is None:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if wait:
            host.copy_(t)
            return host
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.side)
        self.pending += 1
        return host

    def fence(self) -> None:
        """The main stream's next work starts after every queued copy (a wait on the GPU; the
        host does not block)."""
        if self.side is not None and self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.pending = 0

    def sync(self) -> None:
        """Block until every queued copy has ended (a host that reads the copies)."""
        if self.side is not None:
            self.side.synchronize()
            self.pending = 0
