"""Programmatic dependent launch (PDL) for the decode path's small Triton kernels.

Between two kernels on a stream (or two nodes of a CUDA graph) the GPU normally waits for the first
to finish and flush before it launches the second. A kernel launched with PDL (`launch_pdl=True`,
Hopper and later) may be launched as soon as every thread block of the kernel before it has exited,
and waits inside, at `gdc_wait()`, for that kernel's memory to be visible; what it does before the
wait (loads of weights and tables no earlier kernel writes) overlaps the previous kernel's end.

Safety: our kernels never call `gdc_launch_dependents()`, so a kernel's blocks exit only after its
own wait, and a PDL kernel therefore starts only when everything before the previous kernel has
completed too (what it reads from two kernels back is there). Loads before the wait may touch only
memory no kernel of the same stream writes after the graph or step began: weights, cos / sin tables,
positions and slot mappings (copied in before the step's first kernel).

KVMESH_PDL=0 turns it off (A/B runs); it is on by default on devices of compute capability 9.0 and
above, and off elsewhere (CPU, the Triton interpreter, older GPUs), where the kernels compile
without the wait.
"""

import os

import torch

ENABLED = os.environ.get("KVMESH_PDL", "0") == "1"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


_capabilities: dict[int, tuple[int, int]] = {}


def _capability(index: int) -> tuple[int, int]:
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]
