"""Page-locked host memory of an exact size, for offloads.

torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two: a
trainer state of 18.6 GB pins 32 GB, and an 84 GB one (a 7B model's fp32 weights and AdamW
state) asks for 128 GB, more than many GPU hosts have. ``pinned_bytes`` maps ordinary
anonymous memory of the size asked and registers exactly those bytes with CUDA
(``cudaHostRegister``): copies from and to it run at the pinned rate and ``is_pinned()`` holds.
The registration ends when the memory is unmapped, after the last tensor over it is gone.
Where CUDA is absent the memory is plain.
"""

from __future__ import annotations

import mmap

import torch

PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context (a background thread's too)."""


class _Registered(mmap.mmap):
    """Anonymous memory that ends its CUDA registration before it is unmapped (the tensor over
    it keeps the mapping alive through the buffer it exported)."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.address = 0


def pinned_bytes(num_bytes: int) -> torch.Tensor:
    """An uninitialised uint8 host tensor of exactly ``num_bytes``, page-locked where CUDA is."""
    if num_bytes <= 0 or not torch.cuda.is_available():
        return torch.empty(num_bytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    memory = _Registered(-1, num_bytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    result = cudart.cudaHostRegister(tensor.data_ptr(), num_bytes, PORTABLE)
    if result != cudart.cudaError.success:
        raise RuntimeError(
            f"could not page-lock {num_bytes / 2**30:.1f} GiB of host memory for the offload: "
            f"{cudart.cudaGetErrorString(result)}; free host memory (the offloaded state lives "
            "there) or keep more of the state on the device"
        )
    memory.address = tensor.data_ptr()
    return tensor
