"""Host-to-device and device-to-host copy rates by the kind of page-locked host memory.

The offloads keep their host copies in ``tensors.pinned.pinned_bytes`` (anonymous memory
registered with ``cudaHostRegister``); the ceilings of ``bench/ceilings.py`` copy from torch's
pinned allocator (``cudaHostAlloc``). This compares, in one process, the same copies from:

- ``host_alloc``: ``torch.empty(pin_memory=True)``;
- ``registered_4k``: anonymous memory on base pages, registered;
- ``pinned_bytes``: what the offloads use (``tensors.pinned.pinned_bytes``);
- ``touched_first``: the same memory with every page written by torch's threads before it is
  registered (whether faulting the pages in parallel shortens the pinning, which at 45.7 GB
  held a 7B trainer's first offload for 20 s).

For each (a ``pinned_rate`` line): the seconds to get the memory (allocation and page-locking),
the share of it on huge pages (``AnonHugePages`` of the mapping, where the kernel reports it),
and the GB/s of one copy of the whole size each way into device memory allocated and used
before (what the ceilings measure). Then (``pinned_rate_onload``) the same host-to-device bytes
from ``pinned_bytes`` into device memory each copy has to get from the driver first, as an
onload does: one allocation; ``--piece`` MiB allocations made first; a piece allocated and its
copy started in turn (``onload_shapes``). The first line names the host's transparent-huge-page
mode.

    python3 bench/pinned_rate.py [--gib 4] [--piece 1024]
"""

from __future__ import annotations

import argparse
import mmap
import time
from pathlib import Path

import torch
from ceilings import _time_cuda, emit

from tandem.tensors.pinned import pinned_bytes


def huge_share(address: int, size: int) -> float | None:
    """The fraction of ``[address, address + size)`` backed by transparent huge pages."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    huge, inside = 0, False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < address + size and address < high
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return huge / size


def registered_base_pages(num_bytes: int) -> tuple[torch.Tensor, object]:
    """Anonymous memory advised against huge pages, registered with CUDA."""
    memory = mmap.mmap(-1, num_bytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(tensor.data_ptr(), num_bytes, 1) == cudart.cudaError.success
    return tensor, memory


def touched_first(num_bytes: int) -> tuple[torch.Tensor, object]:
    """Anonymous memory whose pages torch's intra-op threads write first, then registered."""
    memory = mmap.mmap(-1, num_bytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    tensor.fill_(0)  # page faults on every thread
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(tensor.data_ptr(), num_bytes, 1) == cudart.cudaError.success
    return tensor, memory


def whole_copies(host: torch.Tensor) -> tuple[float, float]:
    """Seconds of one copy of all of ``host`` to the device and one back."""
    device = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    h2d = _time_cuda(lambda: device.copy_(host, non_blocking=True), repeats=5)
    d2h = _time_cuda(lambda: host.copy_(device, non_blocking=True), repeats=5)
    return h2d, d2h


def rates(host: torch.Tensor) -> dict[str, float]:
    h2d, d2h = whole_copies(host)
    torch.cuda.empty_cache()
    return {
        "h2d_gb_s": round(host.numel() / h2d / 1e9, 2),
        "d2h_gb_s": round(host.numel() / d2h / 1e9, 2),
    }


def onload_shapes(host: torch.Tensor, piece: int, repeats: int = 3) -> dict[str, float]:
    """GB/s of ``host`` copied into device memory the copy itself had to get first, as an
    onload gets it (the cache emptied before each repeat, so every allocation is the
    driver's), in three shapes: one allocation then one copy; every ``piece`` allocated, then
    their copies; a piece allocated and its copy started, then the next (what
    ``StorageOffload.onload`` does). Each shape's seconds from the first allocation to the
    last copy's end (median of ``repeats``), and in the first two the copies' own seconds."""
    num_bytes = host.numel()
    starts = list(range(0, num_bytes, piece))
    sizes = [min(piece, num_bytes - s) for s in starts]
    figures: dict[str, list[float]] = {}

    def timed(shape: str) -> None:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        copy_start = torch.cuda.Event(enable_timing=True)
        copy_end = torch.cuda.Event(enable_timing=True)
        if shape == "interleaved":
            copy_start.record()
            parts = []
            for s, n in zip(starts, sizes, strict=True):
                parts.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                parts[-1].copy_(host[s : s + n], non_blocking=True)
        else:
            if shape == "one_allocation":
                whole = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
                parts = [whole[s : s + n] for s, n in zip(starts, sizes, strict=True)]
            else:
                parts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
            copy_start.record()
            for part, s in zip(parts, starts, strict=True):
                part.copy_(host[s : s + part.numel()], non_blocking=True)
        copy_end.record()
        copy_end.synchronize()
        figures.setdefault(f"{shape}_gb_s", []).append(
            num_bytes / (time.perf_counter() - begin) / 1e9
        )
        figures.setdefault(f"{shape}_copies_gb_s", []).append(
            num_bytes / (copy_start.elapsed_time(copy_end) / 1e3) / 1e9
        )
        del parts

    for _ in range(repeats):
        for shape in ("one_allocation", "allocated_first", "interleaved"):
            timed(shape)
    torch.cuda.empty_cache()
    return {key: round(sorted(v)[len(v) // 2], 2) for key, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--piece", type=int, default=1024, help="MiB per device allocation")
    args = parser.parse_args()
    num_bytes, piece = int(args.gib * 2**30), args.piece * 2**20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    emit({"figure": "pinned_rate_host", "thp": thp.read_text().strip() if thp.exists() else None,
          "device": torch.cuda.get_device_name()})  # fmt: skip
    for kind in ("host_alloc", "registered_4k", "pinned_bytes", "touched_first"):
        start = time.perf_counter()
        keep: object = None
        if kind == "host_alloc":
            host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        elif kind == "registered_4k":
            host, keep = registered_base_pages(num_bytes)
        elif kind == "touched_first":
            host, keep = touched_first(num_bytes)
        else:
            host = pinned_bytes(num_bytes)
        seconds = time.perf_counter() - start
        host.fill_(7)
        emit({"figure": "pinned_rate", "kind": kind, "gib": args.gib,
              "get_s": round(seconds, 3), "huge_share": huge_share(host.data_ptr(), num_bytes),
              **rates(host)})  # fmt: skip
        if kind == "pinned_bytes":
            emit({"figure": "pinned_rate_onload", "gib": args.gib, "piece_mib": args.piece,
                  **onload_shapes(host, piece)})  # fmt: skip
        if kind in ("registered_4k", "touched_first"):  # registration ends before the mapping
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host, keep


if __name__ == "__main__":
    main()
