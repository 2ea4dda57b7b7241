"""A NCCL communicator of our own through ctypes: the all-reduce the tensor-parallel decoder needs on CUDA.

Why not torch.distributed's NCCL process group: ProcessGroupNCCL tracks each collective for its watchdog and,
before a CUDA graph capture begins, waits for that tracking to drain; with the decoder's collectives captured
inside the decode graphs, the first TP 2 capture on an H200 pair hung (both ranks, no error) where eager steps
ran. torch.cuda.nccl.init_rank would be the simple way, but fails on Python 3.12 (SystemError:
PY_SSIZE_T_CLEAN), so this binds libnccl (already loaded by torch's CUDA build) directly, as vLLM's pynccl does.
An ncclAllReduce here is a kernel launch on the current stream: a graph captures it like any other kernel.

No watchdog and no timeout of its own: a rank that dies mid-collective leaves the others inside the kernel
until TPGroup's rank-exit watch (engine/tp/group.py) sees the death and calls abort().
"""

from __future__ import annotations

import ctypes

import torch

NCCL_UNIQUE_ID_BYTES = 128
_SUM = 0  # ncclRedOp_t ncclSum
_DTYPES = {  # ncclDataType_t
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    pass


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libnccl.so.2")  # the copy torch's CUDA build loaded
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
    lib.ncclAllReduce.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
    return lib


class NcclComm:
    """One rank's member of a communicator of `size` ranks (every rank constructs it with the same unique id)."""

    def __init__(self, size: int, rank: int, unique_id: bytes) -> None:
        self._lib = _lib()
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        self._comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(self._comm), size, uid, rank), "ncclCommInitRank")

    @staticmethod
    def unique_id() -> bytes:
        """Rank 0 makes it; the others receive it (any channel) before constructing their NcclComm."""
        lib, uid = _lib(), _UniqueId()
        result = lib.ncclGetUniqueId(ctypes.byref(uid))
        if result:
            raise NcclError(f"ncclGetUniqueId failed: {lib.ncclGetErrorString(result).decode()}")
        return bytes(uid.internal)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` (contiguous, on this rank's GPU) over the ranks, in place, on the current stream."""
        if not x.is_contiguous() or x.dtype not in _DTYPES:
            raise NcclError(f"all_reduce needs a contiguous tensor of a NCCL dtype, got {x.dtype} {tuple(x.stride())}")
        if not self._comm.value:
            raise NcclError("the NCCL communicator was aborted (a tensor-parallel rank died)")
        stream = torch.cuda.current_stream(x.device).cuda_stream
        ptr = x.data_ptr()
        result = self._lib.ncclAllReduce(ptr, ptr, x.numel(), _DTYPES[x.dtype], _SUM, self._comm, stream)
        self._check(result, "ncclAllReduce")

    def abort(self) -> None:
        """From any thread: end this rank's uncompleted collectives (a peer died), so whatever waits on them
        returns; the communicator is unusable afterwards (every later all_reduce raises NcclError)."""
        comm, self._comm = self._comm, ctypes.c_void_p()
        if comm.value:
            self._lib.ncclCommAbort(comm)

    def close(self) -> None:
        if self._comm.value:
            self._lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()

    def _check(self, result: int, what: str) -> None:
        if result:
            raise NcclError(f"{what} failed: {self._lib.ncclGetErrorString(result).decode()}")
