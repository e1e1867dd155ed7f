"""What a rank file is written from: tensors' bytes as they lie, or a save's staging buffer.

A blocking save writes each tensor's bytes straight from the tensor (``tensor_bytes``: a CPU
view, no serialized copy of the file). A save with ``blocking=False`` must return before the
write, while training goes on changing the tensors in place, so it first copies this rank's
tensors into ``STAGING``: host memory allocated at the first such save and reused by every
later one (the rank owns the same bytes each save: the plan says which, and ``gradsync plan
--zero N`` prints how many), grown only when a save needs more, pinned when the tensors are
on a GPU so the copies run at full speed. At most one save is in flight per process
(``gradsync_core.checkpoint.wait_for_saves``), so one buffer per process serves them all.
"""

from __future__ import annotations

import torch

from gradsync_core.checkpoint import SharedStaging, StagedTensor, TensorBytes

# safetensors' dtype names (its ``_TYPES``), for the tensors a checkpoint holds.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> list[TensorBytes]:
    """The tensors of a rank file, each as its bytes in C order (CPU tensors, no copy but
    for a non-contiguous one), for ``gradsync_core.checkpoint.tensor_file``.

    Raises:
        ValueError: a dtype safetensors cannot store.
    """
    out = []
    for key, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store"
            )
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        out.append(TensorBytes(key, _SAFETENSORS_DTYPES[tensor.dtype], tuple(tensor.shape), data))
    return out


class StagingBuffer:
    """Host memory that saves with ``blocking=False`` copy a rank's tensors into; allocated
    once, reused, grown only when a save needs more (``nbytes``: its size now). It is shared
    memory (``gradsync_core.checkpoint.SharedStaging``) that the save's writer process reads
    (``places`` says where each tensor lies), pinned (registered with CUDA) when the tensors
    are on a GPU."""

    def __init__(self) -> None:
        self.memory = SharedStaging()
        self._buffer: torch.Tensor | None = None
        self._pinned = False

    @property
    def nbytes(self) -> int:
        """Bytes allocated (0 before the first save without blocking)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the buffer; returns views of it, by key, with each tensor's
        shape and dtype. The copies are complete on return (a GPU's included). The previous
        views are overwritten: call only once their save has ended."""
        # Each tensor starts at a multiple of its element size (a view of another dtype must),
        # so a rank whose tensors share one dtype stages exactly the bytes it owns.
        offsets, needed = {}, 0
        for key, tensor in tensors.items():
            needed = -(-needed // tensor.element_size()) * tensor.element_size()
            offsets[key] = needed
            needed += tensor.numel() * tensor.element_size()
        from_gpu = any(t.is_cuda for t in tensors.values())
        buffer = self._buffer
        if buffer is None or buffer.numel() < needed:
            self._unpin()
            self._buffer = None  # the old one is freed before the new one is allocated
            buffer = torch.frombuffer(self.memory.reserve(needed), dtype=torch.uint8)
            self._buffer = buffer
        if from_gpu and not self._pinned:
            self._pin()
        staged = {}
        with torch.no_grad():
            for key, tensor in tensors.items():
                start = offsets[key]
                stop = start + tensor.numel() * tensor.element_size()
                view = buffer[start:stop].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach(), non_blocking=from_gpu)
                staged[key] = view
        if from_gpu:
            torch.cuda.synchronize()  # the save returns once the bytes are on the host
        return staged

    def places(self, staged: dict[str, torch.Tensor]) -> list[StagedTensor]:
        """Where each of ``stage``'s views lies in the shared memory, for the writer process.

        Raises:
            ValueError: a dtype safetensors cannot store, or a tensor not in this buffer.
        """
        assert self._buffer is not None
        base, end = self._buffer.data_ptr(), self._buffer.data_ptr() + self._buffer.numel()
        out = []
        for key, tensor in staged.items():
            if tensor.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(
                    f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store"
                )
            start = tensor.data_ptr()
            if tensor.numel() and not (base <= start and start + tensor.nbytes <= end):
                raise ValueError(f"tensor {key!r} is not in the staging buffer; stage() it first")
            offset = start - base if tensor.numel() else 0
            dtype = _SAFETENSORS_DTYPES[tensor.dtype]
            out.append(StagedTensor(key, dtype, tuple(tensor.shape), offset))
        return out

    def _pin(self) -> None:
        """Register the buffer with CUDA, as a pinned allocation is, so that the copies from
        the GPU run at full speed (as DCP's process-mode staging does)."""
        assert self._buffer is not None
        cudart = torch.cuda.cudart()
        # 1: cudaHostRegisterPortable, pinned for every CUDA context.
        code = int(cudart.cudaHostRegister(self._buffer.data_ptr(), self._buffer.numel(), 1))
        if code != 0:
            raise RuntimeError(f"cannot pin the save's staging buffer: cudaError {code}")
        self._pinned = True

    def _unpin(self) -> None:
        if self._pinned and self._buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._pinned = False


# The process's staging buffer: one save in flight at a time, so one buffer.
STAGING = StagingBuffer()
