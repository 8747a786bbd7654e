"""Host -> device copies that never make the host wait for the GPU.

A copy from pageable memory may synchronize with the stream, which would stall async scheduling
(the host preparing step N+1 while the GPU runs step N). Staging through pinned memory (PyTorch's
caching host allocator keeps the buffer alive until the copy is done) keeps the copy asynchronous.
"""

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list, numpy array or CPU tensor as a tensor on `device`, copied asynchronously."""
    if isinstance(values, np.ndarray):
        tensor = torch.from_numpy(values)
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
    elif isinstance(values, torch.Tensor):
        tensor = values.to(dtype)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
