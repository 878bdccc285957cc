"""Find, load and launch the built Hopper kernels through cuda-python (cuda-bindings).

The build (``CMakeLists.txt``) leaves ``prepare.fatbin``, ``recurrence.fatbin`` and
``decode.fatbin`` beside this file. They are loaded once per process as context-independent
libraries (``cuLibraryLoadData``), so one load serves every GPU, and launched with
``cuLaunchKernel`` on torch's current stream: libcuda's own entry point called through ctypes,
or cuda-bindings' wrapper where ``libcuda.so.1`` cannot be opened by name. The chunk kernels
take one by-value :class:`Params` block, the decode kernels a :class:`DecodeParams` block and
the chunk tables' builder (kda.tables) a :class:`TablesParams` block; its bytes live in a
ctypes structure filled in place with one ``struct.pack_into``, and the launch passes the
address of a prebuilt one-entry pointer array, so no per-call argument packing happens in
Python.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from functools import cache
from pathlib import Path

from kda import abi

ARTEFACTS = ("prepare.fatbin", "recurrence.fatbin", "decode.fatbin")
# What the kernels share with Python, from the one source the build also generates their
# header from (src/kda/abi.py -> kda_abi.h): nothing below is a hand copy of the C++ side.
WORKSPACE_BYTES = abi.WORKSPACE_BYTES  # per (chunk, head)
WORKSPACE_FIELDS = abi.WORKSPACE_FIELDS  # name -> (byte offset, dtype, shape) within one block
STAGES = abi.STAGES
PREPARE_THREADS = abi.PREPARE_THREADS
RECURRENCE_WIDTHS = abi.RECURRENCE_WIDTHS  # warps per recurrence CTA: one entry point each
HEAD_DIM = abi.HEAD_DIM
FLAGS = abi.FLAGS  # the Params::flags bits
_CTYPES = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "f64": ctypes.c_double}


class Params(ctypes.Structure):
    """``kda::Params`` (abi.PARAMS): 8-byte fields, in order."""

    _fields_ = [(name, _CTYPES[kind]) for name, _, kind in abi.PARAMS]


class DecodeParams(ctypes.Structure):
    """``kda::DecodeParams`` (abi.DECODE_PARAMS): 8-byte fields, in order."""

    _fields_ = [(name, _CTYPES[kind]) for name, _, kind in abi.DECODE_PARAMS]


def _packing(block: type[ctypes.Structure]) -> struct.Struct:
    """A block as one struct.pack_into (the ctypes fields' own type codes, native layout):
    filling it per call then costs one C call instead of 22 ctypes attribute sets (0.45 us vs 1.3)."""
    assert ctypes.sizeof(block) == 8 * len(block._fields_)
    layout = struct.Struct("@" + "".join(ctype._type_ for _, ctype in block._fields_))
    assert layout.size == ctypes.sizeof(block)
    return layout


class TablesParams(ctypes.Structure):
    """``kda::TablesParams`` (abi.TABLES_PARAMS): 8-byte fields, in order."""

    _fields_ = [(name, _CTYPES[kind]) for name, _, kind in abi.TABLES_PARAMS]


PARAMS_LAYOUT = _packing(Params)
DECODE_PARAMS_LAYOUT = _packing(DecodeParams)
TABLES_PARAMS_LAYOUT = _packing(TablesParams)
# Every decode entry point: (state dtype, final state dtype, V first, columns) -> name (decode.cu)
DECODE_KERNELS = {
    (dtype, final, v_first, columns): abi.decode_kernel_name(dtype, v_first, columns, final)
    for dtype, final in abi.DECODE_STATE_PAIRS
    for v_first in (False, True)
    for columns in abi.DECODE_COLUMNS
}


def driver_launch():
    """libcuda's ``cuLaunchKernel`` as a ctypes function, or None where ``libcuda.so.1``
    cannot be opened (launches then go through cuda-bindings, whose wrapper spends several
    microseconds a launch building argument objects and a result tuple).

    The C signature: ``CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY,
    gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, CUstream hStream,
    void **kernelParams, void **extra)``. No argtypes, which would double the cost of the
    call to about a microsecond: :meth:`Kernels.launch` passes every pointer as a
    ``c_void_p`` object (a bare Python int would go as a 32-bit C int, cut) and the sizes as
    Python ints, which go as 32-bit C ints, the width of the unsigned ints (the grid and
    block sizes and shared bytes of these kernels are far below 2**32)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    launch = libcuda.cuLaunchKernel
    launch.restype = ctypes.c_int
    return launch


# Per recurrence width: its entry point and dynamic shared memory, looked up once per call.
# Keyed by (16-row V groups, warps a group's K is split among).
RECURRENCE_KERNELS = {
    (warps, 1): (f"kda_recurrence_w{warps}", abi.recurrence_shared_bytes(warps)) for warps in RECURRENCE_WIDTHS
} | {
    (warps, 2): (f"kda_recurrence_w{warps}k2", abi.recurrence_shared_bytes(warps, 2))
    for warps in abi.RECURRENCE_SPLIT_WIDTHS
}
# K2 on wgmma (abi.WGMMA_*): per count of CTAs an SM, its entry point and dynamic shared memory.
RECURRENCE_WGMMA_KERNELS = {
    ctas: (abi.wgmma_kernel_name(ctas), abi.wgmma_shared_bytes(ctas)) for ctas in abi.WGMMA_STAGES
}
# The same, two runs on one K1 workspace in one launch (forward.chunk_forward_runs).
RECURRENCE_WGMMA_RUNS_KERNELS = {
    ctas: (abi.wgmma_runs_kernel_name(ctas), abi.wgmma_shared_bytes(ctas)) for ctas in abi.WGMMA_STAGES
}
# The training backward's reverse chain: K2's pipeline and stages, so its shared memory.
CHAIN_KERNELS = {
    warps: (f"kda_state_grad_chain_w{warps}", abi.recurrence_shared_bytes(warps)) for warps in abi.CHAIN_WIDTHS
}

# The training backward's state products (recurrence.cu): one entry point, its shared memory.
PRODUCTS_KERNEL = ("kda_state_products", abi.products_shared_bytes())
PRODUCT_THREADS = 32 * (abi.PRODUCT_WARPS + 1)  # the consumer warps and one producer warp
# recurrence.fatbin's entry points with their dynamic shared memory (set as each one's maximum).
SIZED_KERNELS = (
    *RECURRENCE_KERNELS.values(), *RECURRENCE_WGMMA_KERNELS.values(), *RECURRENCE_WGMMA_RUNS_KERNELS.values(),
    *CHAIN_KERNELS.values(), PRODUCTS_KERNEL,
)  # fmt: skip


def xor_pieces(grouped):
    """``[..., R, P, 8]`` (rows of P 16-byte pieces of bf16): piece p of row r moved to p ^ (r % 8),
    the XOR swizzle of both stored tile layouts; its own inverse."""
    import torch

    R, P = grouped.shape[-3:-1]
    rows = torch.arange(R, device=grouped.device)[:, None]
    return grouped[..., rows, torch.arange(P, device=grouped.device)[None, :] ^ (rows % 8), :]


def swizzle_tiles(tiles):
    """Row-major ``[..., 16, 128]`` tiles <-> the stored layout of kda_cuda.cuh ``tile_offset``
    (16-byte piece c of row r at piece c ^ (r % 8)). The map is its own inverse."""
    return xor_pieces(tiles.reshape(*tiles.shape[:-1], 16, 8)).reshape(tiles.shape)


def sw128_tiles(x):
    """Row-major bf16 ``[..., R, 128]`` -> the wgmma K2's stored layout (abi.WGMMA_TILES): two
    64-column halves of ``[R, 128 B]``, 16-byte piece p of row r at p ^ (r % 8); as ``[..., 2 R, 64]``
    (the halves one after the other). :func:`unsw128_tiles` is its inverse."""
    R = x.shape[-2]
    halves = x.reshape(*x.shape[:-2], R, 2, 8, 8).transpose(-4, -3)  # [..., half, row, piece, 8]
    return xor_pieces(halves).reshape(*x.shape[:-2], 2 * R, 64)


def unsw128_tiles(stored):
    """:func:`sw128_tiles`' inverse: ``[..., 2 R, 64]`` as stored -> row-major ``[..., R, 128]``."""
    R = stored.shape[-2] // 2
    halves = xor_pieces(stored.reshape(*stored.shape[:-2], 2, R, 8, 8))  # [..., half, row, piece, 8]
    return halves.transpose(-4, -3).reshape(*stored.shape[:-2], R, 128)


def workspace_views(workspace, num_chunks: int, heads: int, wgmma: bool = False) -> dict:
    """Named row-major copies ``[num_chunks, heads, *shape]`` of K1's workspace fields (tests
    compare them with the Triton prepare stage); ``wgmma``: as kda_prepare_wgmma stores its
    three tiles (abi.WGMMA_TILES)."""
    import torch

    blocks = workspace[: num_chunks * heads * WORKSPACE_BYTES].view(num_chunks, heads, WORKSPACE_BYTES)
    views = {}
    for name, (offset, dtype, shape) in WORKSPACE_FIELDS.items():
        dt = getattr(torch, dtype)
        size = dt.itemsize * int(torch.Size(shape).numel())
        if shape == (16, 128) and wgmma:
            continue  # read below, in the wgmma layout
        views[name] = blocks[:, :, offset : offset + size].contiguous().view(dt).view(num_chunks, heads, *shape)
        if shape == (16, 128):
            views[name] = swizzle_tiles(views[name])
    if wgmma:
        for tile, (offset, rows) in abi.WGMMA_TILES.items():
            size = rows * 128 * 2
            stored = blocks[:, :, offset : offset + size].contiguous().view(torch.bfloat16)
            rowmajor = unsw128_tiles(stored.view(num_chunks, heads, 2 * rows, 64))
            if tile == "wq":
                views["w"], views["q_decayed"] = rowmajor[..., : abi.CHUNK, :], rowmajor[..., abi.CHUNK :, :]
            else:
                views["k_restored"] = rowmajor
    return views


def artefact_dir() -> Path | None:
    """The folder of the built kernels, or None (:func:`find_kernels` says why)."""
    return find_kernels()[0]


def find_kernels() -> tuple[Path | None, str | None]:
    """``(folder, None)``, where the built kernels are, or ``(None, why not)``. The folder is
    ``KDA_CUDA_KERNELS_DIR`` when set (that folder only: one that lacks the kernels is an error,
    not a fall back to others, which a benchmark's A/B of two builds would not notice), else
    this package's folder or a ``kda/cuda`` folder on ``sys.path`` (an editable install keeps
    its built files in site-packages while the Python sources stay in the checkout). Whether
    they were built from this package's abi.py is :func:`stale`'s question."""
    named = os.environ.get("KDA_CUDA_KERNELS_DIR")
    if named:
        candidates, where = [Path(named)], f"KDA_CUDA_KERNELS_DIR={named}"
    else:
        candidates = [Path(__file__).parent, *(Path(entry) / "kda" / "cuda" for entry in sys.path if entry)]
        where = "kda/cuda"
    for folder in candidates:
        if all((folder / name).is_file() for name in ARTEFACTS):
            return folder, None
    return None, f"CUDA kernels not built: no {' / '.join(ARTEFACTS)} in {where}"


def stale(folder: Path) -> str | None:
    """Why the kernels in ``folder`` do not match this package's :mod:`kda.abi`, or None."""
    try:
        stamp = (folder / abi.HEADER_ID_FILE).read_text().strip()
    except OSError:
        stamp = None
    if stamp == abi.header_id():
        return None
    built = f"another header ({stamp})" if stamp else f"no {abi.HEADER_ID_FILE} stamp"
    return (
        f"the CUDA kernels in {folder} were built from {built}, not this package's kda/abi.py "
        f"({abi.header_id()}): rebuild them (pip install . again; an editable install does not rebuild)"
    )


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message carries the driver's own text."""


def check(result, what: str):
    """Unpack a cuda-bindings ``(CUresult, *values)`` tuple, raising on failure."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{what} failed: {err.name}: {text}")
    return values[0] if len(values) == 1 else values


class Kernels:
    """The loaded kernels and the reusable launch state."""

    def __init__(self, folder: Path):
        from cuda.bindings import driver

        self.driver = driver
        check(driver.cuInit(0), "cuInit")
        self.libraries = []
        self.kernels = {}
        entry_points = {
            # K1's entry points and their wgmma twins, and the tables kernel
            "prepare.fatbin": (*abi.PREPARE_WGMMA_TWINS, *abi.PREPARE_WGMMA_TWINS.values(), abi.TABLES_KERNEL),
            "recurrence.fatbin": tuple(name for name, _ in SIZED_KERNELS),
            "decode.fatbin": tuple(DECODE_KERNELS.values()),
        }
        for artefact, names in entry_points.items():
            image = (folder / artefact).read_bytes()
            library = check(driver.cuLibraryLoadData(image, None, None, 0, None, None, 0), f"loading {artefact}")
            self.libraries.append(library)
            for name in names:
                try:
                    self.kernels[name] = check(driver.cuLibraryGetKernel(library, name.encode()), f"finding {name}")
                except CudaError as error:  # (the stamp covers the ABI header, not the entry points)
                    raise CudaError(
                        f"{folder / artefact} has no entry point {name}: built from older sources than this "
                        f"package's; rebuild them (pip install . again) ({error})"
                    ) from None
        self.params = Params()
        self.argument_array = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        # (the second block of a two-run launch, the "runs" arguments: both blocks)
        self.second_params = Params()
        self.runs_argument_array = (ctypes.c_void_p * 2)(
            ctypes.addressof(self.params), ctypes.addressof(self.second_params)
        )
        self.decode_params = DecodeParams()
        self.decode_argument_array = (ctypes.c_void_p * 1)(ctypes.addressof(self.decode_params))
        self.tables_params = TablesParams()
        self.tables_argument_array = (ctypes.c_void_p * 1)(ctypes.addressof(self.tables_params))
        self.configured_devices: set[int] = set()
        self.threads = threading.local()  # .bound: the devices whose context this thread has made current
        self.lock = threading.Lock()
        self.direct_launch = driver_launch()
        # The direct launch's pointer arguments that never change, as ctypes pointers once.
        self.handles = {name: ctypes.c_void_p(int(kernel)) for name, kernel in self.kernels.items()}
        # Per parameter block (launch's ``block``): its argument array's address, as the
        # cuda-bindings launch takes it, and as the direct launch's ctypes pointer.
        self.arguments = {
            block: (ctypes.addressof(array), ctypes.c_void_p(ctypes.addressof(array)))
            for block, array in (
                ("chunk", self.argument_array),
                ("runs", self.runs_argument_array),
                ("decode", self.decode_argument_array),
                ("tables", self.tables_argument_array),
            )
        }
        self.arguments_pointer = self.arguments["chunk"][1]  # (benchmarks/host_parts.py times launches with it)

    def set_params(self, values: tuple) -> None:
        """Write the :class:`Params` block: ``values`` in field order (hold :attr:`lock`)."""
        PARAMS_LAYOUT.pack_into(self.params, 0, *values)

    def set_second_params(self, values: tuple) -> None:
        """Write the second :class:`Params` block of a "runs" launch (hold :attr:`lock`)."""
        PARAMS_LAYOUT.pack_into(self.second_params, 0, *values)

    def set_decode_params(self, values: tuple) -> None:
        """Write the :class:`DecodeParams` block: ``values`` in field order (hold :attr:`lock`)."""
        DECODE_PARAMS_LAYOUT.pack_into(self.decode_params, 0, *values)

    def set_tables_params(self, values: tuple) -> None:
        """Write the :class:`TablesParams` block: ``values`` in field order (hold :attr:`lock`)."""
        TABLES_PARAMS_LAYOUT.pack_into(self.tables_params, 0, *values)

    def bind_context(self, device_index: int) -> None:
        """Once per thread and device: make sure a context is current for the launches. The
        kernels come from context-independent libraries and launch in the calling thread's
        current context; a thread that has only met torch's cached allocator and streams may
        have none, and then gets ``device_index``'s primary context (torch's)."""
        try:
            bound = self.threads.bound
        except AttributeError:  # this thread's first launch
            bound = self.threads.bound = set()
        if device_index in bound:
            return
        driver = self.driver
        if not int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):
            device = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
            primary = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        bound.add(device_index)

    def configure(self, device_index: int) -> None:
        """Per device, once: allow the recurrence its dynamic shared memory (over 48 KB), and
        ask for the largest shared-memory carveout for both kernels, so that shared memory
        never holds the number of resident CTAs below what their registers allow (the driver
        sizes the carveout by its own estimate of residency; K1's six CTAs of 35.2 KB, with the
        1 KB an SM reserves a CTA, need 217 KB of the 228)."""
        if device_index in self.configured_devices:
            return
        driver = self.driver
        device = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        attributes = driver.CUfunction_attribute
        settings = [  # the carveout in percent of the maximum
            (attributes.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100, kernel)
            for kernel in self.kernels.values()
        ]
        settings += [
            (attributes.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes, self.kernels[name])
            for name, shared_bytes in SIZED_KERNELS
        ]
        for attribute, value, kernel in settings:
            check(driver.cuKernelSetAttribute(attribute, value, kernel, device), "cuKernelSetAttribute")
        self.configured_devices.add(device_index)

    def launch(
        self, name: str, grid: tuple[int, int], threads: int, smem: int, stream: int, block: str = "chunk"
    ) -> None:
        """Launch ``name`` with the current contents of its parameter block: ``block`` "chunk"
        (:attr:`params`), "runs" (:attr:`params`, then :attr:`second_params`), "decode"
        (:attr:`decode_params`) or "tables" (:attr:`tables_params`).
        The driver copies it at launch, so the block may be refilled for the next launch at once."""
        if not (0 < grid[0] < 2**31 and 0 < grid[1] < 2**16):  # ctypes would wrap past 2^32 silently
            raise ValueError(f"{name}: grid {grid} is outside CUDA's limits (x < 2^31, y < 2^16)")
        address, pointer = self.arguments[block]
        if self.direct_launch is None:
            check(
                self.driver.cuLaunchKernel(
                    self.kernels[name], grid[0], grid[1], 1, threads, 1, 1, smem, stream, address, 0
                ),
                f"launching {name}",
            )
            return
        status = self.direct_launch(
            self.handles[name], grid[0], grid[1], 1, threads, 1, 1, smem, ctypes.c_void_p(stream), pointer, None
        )
        if status:
            self.launch_failed(name, status)

    def launch_failed(self, name: str, status: int) -> None:
        """Raise :class:`CudaError` for a failed direct launch, with the driver's own text."""
        try:
            error = self.driver.CUresult(status)
        except ValueError:  # a code newer than this cuda-bindings
            raise CudaError(f"launching {name} failed: CUresult {status}") from None
        check((error,), f"launching {name}")


@cache
def kernels() -> Kernels:
    folder, why = find_kernels()
    why = why or stale(folder)
    if why is not None:
        raise CudaError(why)
    return Kernels(folder)
