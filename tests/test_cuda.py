"""The CUDA backend. On any machine: the build produced the kernels where nvcc exists, the
compiler lays out the shared ABI (src/kda/abi.py) as the loader's ctypes do, and unsupported calls are
refused with the feature named. On a Hopper GPU (``gpu`` marker): CUDA against the fp64
reference and against Triton, full writes, no stray writes, strict causality, the fast path
really running, CUDA-graph capture."""

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda
from helpers import (
    assert_bands_untouched,
    assert_close_fp64,
    assert_graph_replays_eager,
    assert_strictly_causal,
    cuda_ready,
    fp64_direct,
    fp64_reference,
    guarded,
    make_case,
    rel,
)
from kda import abi
from kda.api import checked_problem
from kda.cuda import BACKEND, loader
from kda.cuda.forward import recurrence_width
from kda.tables import chunk_tables

SOURCES = Path(loader.__file__).parent
HEADER = (SOURCES / "kda_cuda.cuh").read_text()


def test_kernels_built_where_nvcc_exists():
    """`pip install` with nvcc present must leave both fatbins where the loader looks; a
    build that silently skipped them would send every call to Triton."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the install skips the CUDA build by design")
    folder, why = loader.find_kernels()
    assert folder is not None, f"nvcc exists but no {loader.ARTEFACTS} were installed: {why}"
    assert loader.stale(folder) is None, "the build stamps its kernels with this abi.py's header_id"


@pytest.mark.parametrize("case", ["opted_out", "nvcc_11"])
def test_the_build_skips_the_kernels_where_it_cannot_or_is_told_not_to(tmp_path, case):
    """CMake's configure step with ``KDA_BUILD_CUDA=0``, and with an nvcc that predates sm_90a
    (a wrapper of the real one reporting release 11.8 and refusing compute_90a, as CUDA 11's
    does): the kernels are skipped with a message, where an old nvcc failed the whole install
    until 2026-12-07 (a review of the build)."""
    nvcc, cmake = shutil.which("nvcc"), shutil.which("cmake")
    if nvcc is None or cmake is None:
        pytest.skip("needs nvcc and cmake on PATH")
    env = {**__import__("os").environ, "KDA_BUILD_CUDA": "0" if case == "opted_out" else "1"}
    args = [cmake, "-S", str(SOURCES.parents[2]), "-B", str(tmp_path / "build")]
    if case == "nvcc_11":
        fake = tmp_path / "nvcc"
        fake.write_text(
            "#!/bin/sh\n"
            'case "$*" in *--version*) echo "Cuda compilation tools, release 11.8, V11.8.89"; exit 0;; esac\n'
            'case "$*" in *compute_90a*) echo "nvcc fatal: Unsupported gpu architecture" >&2; exit 1;; esac\n'
            f'exec {nvcc} "$@"\n'
        )
        fake.chmod(0o755)
        args.append(f"-DCMAKE_CUDA_COMPILER={fake}")
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    want = "KDA_BUILD_CUDA=0" if case == "opted_out" else "nvcc 11.8 predates sm_90a"
    assert run.returncode == 0 and want in run.stdout, run.stdout + run.stderr
    assert "building CUDA kernels" not in run.stdout


def kernels_folder(path: Path, stamp: str | None) -> Path:
    """A folder holding the kernels' names (not their images) and ``stamp``, if any."""
    path.mkdir()
    for name in loader.ARTEFACTS:
        (path / name).write_bytes(b"not a fatbin")
    if stamp is not None:
        (path / abi.HEADER_ID_FILE).write_text(stamp + "\n")
    return path


def test_a_named_kernels_folder_is_the_only_one_looked_in(tmp_path, monkeypatch):
    """``KDA_CUDA_KERNELS_DIR`` naming a folder without the kernels is refused, naming it: it
    fell back to the package's own kernels without a word until 2026-12-07 (a device A/B of
    two builds would have timed one build twice)."""
    for named in (tmp_path / "absent", kernels_folder(tmp_path / "two", None)):
        (named / loader.ARTEFACTS[1]).unlink(missing_ok=True)
        monkeypatch.setenv("KDA_CUDA_KERNELS_DIR", str(named))
        folder, why = loader.find_kernels()
        assert folder is None and f"KDA_CUDA_KERNELS_DIR={named}" in why, why
    monkeypatch.setenv("KDA_CUDA_KERNELS_DIR", str(kernels_folder(tmp_path / "whole", None)))
    assert loader.find_kernels() == (tmp_path / "whole", None)


def test_kernels_built_from_another_abi_are_refused(tmp_path):
    """The build's stamp (abi.header_id, beside the fatbins) against this package's abi.py:
    kernels built from another read the parameter blocks in another layout, and an editable
    install does not rebuild them after a pull (a review, 2026-12-07, found this checkout's
    venv running a K1 from before the last kernel fix)."""
    assert loader.stale(kernels_folder(tmp_path / "same", abi.header_id())) is None
    for name, stamp in (("other", "0123456789abcdef"), ("unstamped", None)):
        why = loader.stale(kernels_folder(tmp_path / name, stamp))
        assert why is not None and str(tmp_path / name) in why and abi.header_id() in why, why
        assert (stamp or abi.HEADER_ID_FILE) in why, why
    header = tmp_path / "kda_abi.h"
    subprocess.run([sys.executable, abi.__file__, str(header), str(tmp_path / "id")], check=True)
    assert (tmp_path / "id").read_text().strip() == abi.header_id()
    assert header.read_text() == abi.header(), "the stamp is the hash of the header the kernels include"


def test_any_hopper_gpu_makes_the_backend_available(tmp_path, monkeypatch):
    """On a host whose current GPU is not sm_90 but another is, the backend is available (each
    call's ``rejects`` tests its own tensors' GPU); it turned off for the whole process from
    the current device's capability until 2026-12-07."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    folder = kernels_folder(tmp_path / "k", abi.header_id())
    capabilities = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(loader, "find_kernels", lambda: (folder, None))
    monkeypatch.setattr(loader, "kernels", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"GPU{i}")
    monkeypatch.setattr(kda.cuda, "_capability", capabilities.__getitem__)
    availability = kda.cuda._static_availability.__wrapped__
    assert availability() is None
    capabilities[1] = (10, 0)
    why = availability()
    assert why is not None and "GPU0 (sm_80), GPU1 (sm_100)" in why, why


# Register ceilings the launch configuration rests on: K1's 128 threads at 6 CTAs an SM
# (65536 / 768, in steps of 8) and its far-row entry point's at 5 (65536 / 640); K2's caps
# (recurrence.cu): registers are allocated per SM sub-partition, 168 fits three warps in one, 128 four.
REGISTER_CEILING = {abi.PREPARE_KERNEL: 80, abi.PREPARE_FAR_KERNEL: 96,
                    "kda_recurrence_w1": 168, "kda_recurrence_w2": 168, "kda_recurrence_w4": 128,
                    "kda_recurrence_w2k2": 128, abi.PREPARE_WGMMA_KERNEL: 80, abi.PREPARE_FAR_WGMMA_KERNEL: 96,
                    # the wgmma K2: 160 threads at one CTA an SM (255 at most), two (ten warps on
                    # four sub-partitions of 16384 registers, three on some: 168; 204 before 2026-12-04
                    # night, past what two CTAs fit)
                    abi.wgmma_kernel_name(1): 255, abi.wgmma_kernel_name(2): 168,
                    # the same K2, two runs a launch (the segment split's): the same ceilings
                    abi.wgmma_runs_kernel_name(1): 255, abi.wgmma_runs_kernel_name(2): 168,
                    "kda_state_grad_chain_w1": 168, "kda_state_grad_chain_w2": 168,
                    # nine warps: three on some SM sub-partition (16384 registers each), so 168 at most
                    loader.PRODUCTS_KERNEL[0]: 168}  # fmt: skip


def abi_include(tmp_path: Path) -> Path:
    """A folder holding kda_abi.h as the build generates it (src/kda/abi.py)."""
    (tmp_path / "kda_abi.h").write_text(abi.header())
    return tmp_path


# Candidate builds, off by default, measured against the default on a GPU before either goes
# (benchmarks/NOTES.md): compiled here with the same checks, so that the A/B's build is sound.
CANDIDATES = (
    ("prepare.cu", ("-DKDA_K1_W_TF32=1",)),  # K1's w in one tf32 product (2026-12-05)
    ("prepare.cu", ("-DKDA_K1_STORE_OFFSETS=1",)),  # K1's tile stores by address bits (8a84845, back for an H200)
    ("prepare.cu", ("-DKDA_K1_W_TF32=1", "-DKDA_K1_STORE_OFFSETS=1")),
    ("prepare.cu", ("-DKDA_K1_A_TF32=1",)),  # K1's A in one tf32 product (2026-12-05)
    ("prepare.cu", ("-DKDA_K1_A_TF32=1", "-DKDA_K1_W_TF32=1")),
    ("prepare.cu", ("-DKDA_K1_A_TF32=1", "-DKDA_K1_W_TF32=1", "-DKDA_K1_STORE_OFFSETS=1")),
)


def ptxas_report(
    source: Path, include: Path, tmp_path: Path, flags: tuple[str, ...] = ()
) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """kernel -> (registers, spill bytes, ptxas' wgmma notes) from ``ptxas -v``, with the build's
    nvcc flags (and ``flags``). The notes are codes such as C7517 (a warpgroup.wait ptxas injected)
    or C7510 (wgmmas it serialised), each a wait the source did not ask for."""
    result = subprocess.run(
        ["nvcc", "-cubin", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90a", "-I", str(include),
         "-I", str(abi_include(tmp_path)), "-Xptxas", "-v", *flags, "-o", str(tmp_path / f"{source.stem}.cubin"),
         str(source)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    # ptxas says "in function 'X'" for an injected wait (C7517) and "in the function 'X'" for
    # serialised wgmmas (C7510, C7520, ...): both, and no note left unattributed.
    notes = re.findall(r"\((C75\d\d)\) .* in (?:the )?function '(\w+)'", result.stderr)
    assert len(notes) == len(re.findall(r"\(C75\d\d\)", result.stderr)), result.stderr
    report = {}
    for entry in result.stderr.split("Compiling entry function '")[1:]:
        name = entry.split("'")[0]
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", entry))
        codes = tuple(code for code, function in notes if function == name)
        report[name] = (int(re.search(r"Used (\d+) registers", entry).group(1)), spills, codes)
    return report


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (H100, H200), the kernels' target",
)
def test_gpu_built_kernels_load_on_hopper():
    """Where the kernels are built, an sm_90 GPU has the CUDA backend: every CUDA test skips by
    ``cuda_ready`` when it has not, so a loader or fatbin failure there would read as skips, not
    failures (a review of the GPU tests, 2026-12-06)."""
    if loader.artefact_dir() is None:
        pytest.skip("no CUDA kernels built (pip install . with nvcc, or KDA_CUDA_KERNELS_DIR)")
    assert kda.cuda._static_availability() is None


def test_kernels_compile_without_spills_within_their_register_ceilings(tmp_path):
    """A spill or a register count past the ceiling costs occupancy the timings depend on
    (benchmarks/NOTES.md): caught here, at compile time, on any machine with nvcc."""
    include = cutlass_include()
    report = {}
    for source in ("prepare.cu", "recurrence.cu", "decode.cu"):
        report |= ptxas_report(SOURCES / source, include, tmp_path)
    assert set(report) == {*abi.PREPARE_WGMMA_TWINS, *abi.PREPARE_WGMMA_TWINS.values(), abi.TABLES_KERNEL,
                           *(name for name, _ in loader.SIZED_KERNELS), *loader.DECODE_KERNELS.values()}  # fmt: skip
    assert {name: spills for name, (_, spills, _) in report.items() if spills} == {}
    # An injected wait turns work meant to overlap the wgmmas into work after them (2026-12-04:
    # the gamma scaling beside the chain cost the wgmma K2 4-8%, benchmarks/NOTES.md run 123).
    assert {name: codes for name, (*_, codes) in report.items() if codes} == {}
    for name, ceiling in REGISTER_CEILING.items():
        assert report[name][0] <= ceiling, f"{name}: {report[name][0]} registers > {ceiling}"
    for source, flags in CANDIDATES:
        candidate = ptxas_report(SOURCES / source, include, tmp_path, flags)
        assert candidate.keys() <= report.keys(), (flags, sorted(candidate))
        assert {name: spills for name, (_, spills, _) in candidate.items() if spills} == {}, flags
        assert {name: codes for name, (*_, codes) in candidate.items() if codes} == {}, flags
        for name, (registers, *_) in candidate.items():
            assert registers <= REGISTER_CEILING.get(name, 255), (flags, name, registers)


def cutlass_include() -> Path:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    cutlass = importlib.util.find_spec("cutlass_library")
    if cutlass is None:
        pytest.skip("the nvidia-cutlass wheel (CUTLASS headers) is not installed")
    return Path(cutlass.submodule_search_locations[0]) / "source" / "include"


def test_a_build_whose_bulk_copies_would_trap_fails(tmp_path):
    """For a plain sm_100 (not sm_100a) CuTe compiles its bulk copies as traps: the build must
    fail, naming the fix, rather than ship kernels that trap (kda_cuda.cuh)."""
    result = subprocess.run(
        ["nvcc", "-cubin", "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_100", "-I", str(cutlass_include()),
         "-I", str(abi_include(tmp_path)), "-o", str(tmp_path / "recurrence.cubin"), str(SOURCES / "recurrence.cu")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "bulk (TMA) copies are disabled" in result.stderr, result.stderr[-2000:]


def test_the_compiler_lays_out_the_abi_as_ctypes_does(tmp_path):
    """kda_abi.h (generated from src/kda/abi.py) as nvcc compiles it against the loader's
    ctypes mirror of the same list: every Params field at the offset and size ctypes gives
    it, each flag at its bit, the workspace offsets and the launch constants. A C type of
    another width in abi.PARAMS, or a generator slip, fails here at compile time."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    checks = [f"sizeof(kda::Params) == {ctypes.sizeof(loader.Params)}"]
    checks += [f"offsetof(kda::Params, {name}) == {getattr(loader.Params, name).offset} && "
               f"sizeof(kda::Params::{name}) == {getattr(loader.Params, name).size}"
               for name, _ in loader.Params._fields_]  # fmt: skip
    checks += [f"sizeof(kda::DecodeParams) == {ctypes.sizeof(loader.DecodeParams)}"]
    checks += [f"offsetof(kda::DecodeParams, {name}) == {getattr(loader.DecodeParams, name).offset} && "
               f"sizeof(kda::DecodeParams::{name}) == {getattr(loader.DecodeParams, name).size}"
               for name, _ in loader.DecodeParams._fields_]  # fmt: skip
    checks += [f"kda::kDecodeThreads == {abi.DECODE_THREADS}"]
    checks += [f"sizeof(kda::TablesParams) == {ctypes.sizeof(loader.TablesParams)}"]
    checks += [f"offsetof(kda::TablesParams, {name}) == {getattr(loader.TablesParams, name).offset} && "
               f"sizeof(kda::TablesParams::{name}) == {getattr(loader.TablesParams, name).size}"
               for name, _ in loader.TablesParams._fields_]  # fmt: skip
    checks += [f"kda::kTablesThreads == {abi.TABLES_THREADS}", f"kda::kTablesSlots == {abi.TABLES_SLOTS}",
               f"kda::kTablesSeqs == {abi.TABLES_SEQS}", f"kda::kOrderMax == {abi.ORDER_MAX}"]  # fmt: skip
    checks += [f"kda::{abi.c_flag_name(name)} == {bit}" for name, bit in loader.FLAGS.items()]
    checks += [f"kda::WorkspaceLayout::{name} == {offset}" for name, (offset, _, _) in loader.WORKSPACE_FIELDS.items()]
    checks += [f"kda::kWorkspaceBytes == {loader.WORKSPACE_BYTES}", f"kda::kStages == {loader.STAGES}",
               f"kda::kPrepareThreads == {loader.PREPARE_THREADS}", f"kda::kHeadDim == {loader.HEAD_DIM}"]  # fmt: skip
    checks += [
        f"kda::recurrence_shared_bytes({w}, {k}) == {shared}"
        for (w, k), (_, shared) in loader.RECURRENCE_KERNELS.items()
    ]
    probe = tmp_path / "probe.cu"
    probe.write_text('#include <cstddef>\n#include "kda_abi.h"\n'
                     + "".join(f'static_assert({c}, "{c}");\n' for c in checks))  # fmt: skip
    result = subprocess.run(["nvcc", "-std=c++17", "-c", "-I", str(abi_include(tmp_path)), "-o",
                             str(tmp_path / "probe.o"), str(probe)], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_abi_generator_writes_what_the_build_runs(tmp_path):
    """CMakeLists.txt runs ``python src/kda/abi.py <header>``: the script, run that way (no
    package import), writes abi.header(), and the kernels include that file."""
    out = tmp_path / "kda_abi.h"
    subprocess.run([sys.executable, str(Path(abi.__file__)), str(out)], check=True)
    assert out.read_text() == abi.header()
    assert '#include "kda_abi.h"' in HEADER
    assert 'src/kda/abi.py" "${KDA_ABI_HEADER}"' in (Path(__file__).parents[1] / "CMakeLists.txt").read_text()


def test_tile_swizzle_matches_the_header_formula():
    """loader.swizzle_tiles puts element (r, c) where kda_cuda.cuh tile_offset says (byte
    r * 256 + ((c / 8) ^ (r % 8)) * 16 + (c % 8) * 2), and undoes itself."""
    tile = torch.arange(16 * 128, dtype=torch.int32).view(16, 128)
    stored = loader.swizzle_tiles(tile).flatten()
    for r in range(16):
        for c in range(0, 128, 3):
            assert stored[(r * 256 + ((c // 8) ^ (r % 8)) * 16 + (c % 8) * 2) // 2] == tile[r, c]
    assert torch.equal(loader.swizzle_tiles(loader.swizzle_tiles(tile)), tile)


def test_wgmma_tile_layout_matches_the_kernels_formula():
    """loader.sw128_tiles puts element (r, c) of an [R, 128] tile where prepare.cu's
    wgmma_tile_offset stores it for the wgmma K2 (byte (c / 64) R 128 + r 128 + (((c % 64) / 8) ^
    (r % 8)) 16 + (c % 8) 2) and unsw128_tiles undoes it; workspace_views(wgmma=True) reads
    w, q_decayed and k_restored back from a block laid out so (abi.WGMMA_TILES)."""
    for R in (16, 32):
        tile = torch.arange(R * 128, dtype=torch.int16).view(R, 128)
        stored = loader.sw128_tiles(tile).flatten()
        for r in range(R):
            for c in range(0, 128, 3):
                at = (c // 64) * R * 128 + r * 128 + (((c % 64) // 8) ^ (r % 8)) * 16 + (c % 8) * 2
                assert stored[at // 2] == tile[r, c], (R, r, c)
        assert torch.equal(loader.unsw128_tiles(loader.sw128_tiles(tile)), tile)
    heads, chunks = 2, 3
    gen = torch.Generator().manual_seed(0)
    w, q, k = (torch.randn(chunks, heads, 16, 128, generator=gen).to(torch.bfloat16) for _ in range(3))
    ws = torch.zeros(chunks * heads * loader.WORKSPACE_BYTES, dtype=torch.uint8)
    blocks = ws.view(chunks, heads, loader.WORKSPACE_BYTES)
    for (offset, rows), tiles in zip(abi.WGMMA_TILES.values(), (torch.cat([w, q], -2), k), strict=True):
        blocks[..., offset : offset + rows * 256] = loader.sw128_tiles(tiles).contiguous().view(torch.uint8).flatten(2)
    views = loader.workspace_views(ws, chunks, heads, wgmma=True)
    assert torch.equal(views["w"], w) and torch.equal(views["q_decayed"], q) and torch.equal(views["k_restored"], k)


def test_workspace_views_decode_the_block_layout():
    heads, chunks = 2, 3
    ws = torch.zeros(chunks * heads * loader.WORKSPACE_BYTES, dtype=torch.uint8)
    blocks = ws.view(chunks, heads, loader.WORKSPACE_BYTES)
    offset, _, _ = loader.WORKSPACE_FIELDS["gamma"]
    blocks[1, 1, offset : offset + 4] = torch.tensor([2.5], dtype=torch.float32).view(torch.uint8)
    views = loader.workspace_views(ws, chunks, heads)
    assert views["gamma"].shape == (chunks, heads, 128) and views["gamma"][1, 1, 0] == 2.5
    assert views["gamma"].count_nonzero() == 1
    assert views["w"].shape == (chunks, heads, 16, 128) and views["w"].dtype == torch.bfloat16


UNSUPPORTED = [
    ("fp16", dict(dtype=torch.float16), "dtype"),
    ("fp32", dict(dtype=torch.float32), "dtype"),  # (a mutation audit of 2026-12-05: fp16 alone was asked)
    ("K=64", dict(K=64, V=64), "head dims"),
    ("GVA", dict(H=2, HV=4), "grouped value heads"),
    ("softplus", dict(gate="softplus"), "softplus"),
]


@pytest.mark.parametrize("name,over,reason", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_calls_are_refused_with_the_feature_named(name, over, reason):
    kw = dict(T=20, H=2, K=128, V=128, dtype=torch.bfloat16, seed=1) | over
    case = make_case(**kw)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert reason in BACKEND.rejects(p)


@pytest.mark.parametrize("name", ["g", "beta"])
def test_gate_inputs_the_kernels_cannot_read_are_refused_by_name(name):
    case = make_case(T=20, H=2, K=128, V=128, dtype=torch.bfloat16, seed=1)
    setattr(case, name, getattr(case, name).double())  # validation allows float64 g and beta
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert BACKEND.rejects(p) == f"`{name}` in torch.float64 (the CUDA kernels read bfloat16 or float32)"


@pytest.mark.parametrize("name", ["q", "k", "v", "g"])
def test_inputs_off_the_copies_alignment_are_named(name):
    """kda.cuda.misaligned names whichever of q, k, v and g is a view off the 16-byte copies'
    alignment (a mutation audit of 2026-12-05 found g left out of its test passing: only q was
    asked, by a training test)."""
    case = make_case(T=20, H=2, K=128, V=128, dtype=torch.bfloat16, seed=1)
    x = getattr(case, name)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)
    setattr(case, name, shifted)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert getattr(p, name).data_ptr() % 16, "the view must stay off the alignment through validation"
    assert kda.cuda.misaligned(p) == f"`{name}` is not 16-byte aligned (a view at an odd offset)"


@pytest.mark.parametrize("where", ["initial", "final"])
def test_bfloat16_states_are_not_refused(where):
    case = make_case(T=20, H=2, K=128, V=128, dtype=torch.bfloat16, seed=2)
    if where == "initial":
        case.initial_state = case.initial_state.to(torch.bfloat16)
    kw = case.kwargs(final_state_dtype=torch.bfloat16) if where == "final" else case.kwargs()
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    assert BACKEND.rejects(p) == "tensors on cpu (needs CUDA tensors)"  # the first check that applies here


def test_training_calls_are_not_refused_for_their_grad():
    """A call with grad runs its forward on the CUDA path and its backward on Triton
    (tests/test_backward.py on the GPU): the refusal here is the CPU tensors', not the grad."""
    case = make_case(T=20, H=2, K=128, V=128, dtype=torch.bfloat16, seed=2)
    q = case.q.clone().requires_grad_()
    p = checked_problem(kda.chunk_kda, q, *case.tensors()[1:], **case.kwargs())
    assert BACKEND.rejects(p) == "tensors on cpu (needs CUDA tensors)"


def test_longest_sequences_are_scheduled_first():
    case = make_case(seq_lens=[3, 10, 0, 7], H=2, K=128, V=128, dtype=torch.bfloat16, seed=3)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert chunk_tables(p).seq_order.tolist() == [2, 3, 6, 7, 0, 1, 4, 5]


def test_recurrence_width_follows_the_pair_count_unless_overridden(switches):
    switches("KDA_CUDA_WARPS", None)
    assert recurrence_width(pairs=32, sms=132) == (2, 2)
    assert recurrence_width(pairs=66, sms=132) == (2, 2)
    assert recurrence_width(pairs=67, sms=132) == (2, 1)
    assert recurrence_width(pairs=96, sms=132) == (2, 1)
    assert recurrence_width(pairs=395, sms=132) == (2, 1)
    assert recurrence_width(pairs=396, sms=132) == (4, 1)
    switches("KDA_CUDA_WARPS", "1")
    assert recurrence_width(pairs=32, sms=132) == (1, 1)
    switches("KDA_CUDA_WARPS", "2k2")
    assert recurrence_width(pairs=96, sms=132) == (2, 2)


def test_bad_cta_width_override_is_refused(switches):
    switches("KDA_CUDA_WARPS", "3")
    with pytest.raises(ValueError, match="KDA_CUDA_WARPS"):
        recurrence_width(pairs=1, sms=132)


def test_compiled_inference_call_takes_the_cuda_path_through_the_custom_op():
    """torch.compile(fullgraph=True) of an inference call that dispatches to the CUDA backend:
    its launch (cuda-python, opaque to dynamo) runs inside kda::chunk_fwd, so the graph does not
    break. On CPU the backend's checks and its forward are stood in for; the GPU test below
    runs the real kernels."""
    import torch._dynamo

    case = make_case(T=20, H=1, K=16, V=16, seed=31)
    want = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
    calls = []

    def stand_in(p):
        calls.append(p.describe())
        return kda.chunk_kda(p.q, p.k, p.v, p.g, p.beta, backend="torch", **case.kwargs())

    torch._dynamo.reset()
    with (
        mock.patch.object(type(BACKEND), "availability", lambda self: None),
        mock.patch.object(type(BACKEND), "rejects", lambda self, p: None),
        mock.patch("kda.cuda.forward.chunk_forward", stand_in),
    ):
        compiled = torch.compile(lambda *t: kda.chunk_kda(*t, backend="cuda", **case.kwargs()), fullgraph=True)
        got = compiled(*case.tensors())
        compiled(*case.tensors())
    # once per call: the forward ran inside the op at run time (traced inline, it would have run
    # once, at trace time, and never again)
    assert len(calls) == 2, calls
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@cuda_ready
def test_gpu_compiled_inference_call_runs_the_cuda_kernels():
    import torch._dynamo

    case = make_case(T=300, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=32)
    want = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
    torch._dynamo.reset()
    with kda.record_dispatch() as events:
        compiled = torch.compile(lambda *t: kda.chunk_kda(*t, **case.kwargs()), fullgraph=True)
        got = compiled(*case.tensors())
    assert any(e.startswith("cuda:") for e in events), events
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@cuda_ready
def test_gpu_inference_mode_and_normal_calls_alternate():
    """Calls inside torch.inference_mode and outside it, in turn, on one stream (``kda bench``
    runs every contender in inference mode since 2026-12-07, and its other steps outside): the
    stream's kept K1 workspace, first made inside, serves both, and each call equals the first."""
    case = make_case(T=300, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=33)
    with torch.inference_mode():
        want = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
    for inference in (False, True, False):
        with torch.inference_mode(inference), kda.record_dispatch() as events:
            got = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
        assert any(e.startswith("cuda:") for e in events), events
        assert all(torch.equal(a, b) for a, b in zip(got, want)), inference


def test_kda_cuda_off_switch(switches):
    switches("KDA_CUDA", "0")
    assert BACKEND.availability() == "turned off by KDA_CUDA=0"
    switches("KDA_CUDA", "1")
    assert BACKEND.availability() != "turned off by KDA_CUDA=0"


# ----------------------------------------------------------------------------- GPU only


@pytest.fixture
def cuda_on(switches):
    """The backend is on unless KDA_CUDA=0: these tests drop that switch."""
    switches("KDA_CUDA", None)


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("value", [float("-inf"), -1e30, -300.0])
@pytest.mark.parametrize("g_fp32", [False, True])
def test_gpu_cuda_hard_resets_are_exact(cuda_on, value, g_fp32):
    """Precomputed g of -inf, -1e30 or -300 (a hard reset of its key channel, spec section 9):
    K1 takes any g below abi.HARD_RESET as HARD_RESET, so the result is the float64 token
    loop's (which zeroes the channel), within bf16 rounding; finite everywhere. Resets on a
    chunk's first and last rows, twice in a chunk, in every channel of one row, in a second
    sequence."""
    case = cuda_case([40, 7, 300], 2, False, "precomputed", g_fp32, True, seed=12)
    g = case.g.clone()
    for t, h, channels in ((0, 0, [0]), (5, 1, [1, 2]), (9, 0, [1]), (15, 0, [3]), (16, 1, [3]),
                           (17, 0, list(range(128))), (44, 1, [5]), (47, 0, [2]), (200, 1, [6])):  # fmt: skip
        g[0, t, h, channels] = value
    case.g = g
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
    assert "cuda:prepare" in events, events
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 5e-3, "o")
    assert_close_fp64(ht, ht_ref, 5e-3, "state")


def cuda_case(seq_lens, H, layout, gate, g_fp32, with_state, seed, steep_steps=0):
    case = make_case(seq_lens=seq_lens, H=H, K=128, V=128, dtype=torch.bfloat16, gate=gate, state_v_first=layout,
                     with_state=with_state, device="cuda", seed=seed, steep_steps=steep_steps)  # fmt: skip
    if g_fp32:
        case.g = case.g.float()
    return case


@pytest.mark.gpu
@cuda_ready
@given(
    seq_lens=st.one_of(  # one sequence of any length up to 20000, or a varlen batch of up to 4
        st.integers(1, 20000).map(lambda t: [t]), st.lists(st.integers(0, 6000), min_size=1, max_size=4)
    ),
    H=st.sampled_from([1, 2, 4]),
    layout=st.booleans(),
    gate=st.sampled_from(["lower_bound", "precomputed"]),
    g_fp32=st.booleans(),
    with_state=st.booleans(),
    steep=st.sampled_from([0, 0, 40]),  # steps of g = -50 (precomputed g): prepare's pairwise rows
    lower_bound=st.sampled_from([-5.0, -3.0, -0.5]),  # the safe gate's range (lower-bound gate only)
    scale=st.sampled_from([None, 0.05]),
    bf16_initial=st.booleans(),
    bf16_final=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gpu_cuda_matches_fp64_and_triton(seq_lens, H, layout, gate, g_fp32, with_state, steep, lower_bound, scale,
                                          bf16_initial, bf16_final, seed):  # fmt: skip
    case = cuda_case(seq_lens, H, layout, gate, g_fp32, with_state, seed, steep_steps=steep)
    if bf16_initial and case.initial_state is not None:
        case.initial_state = case.initial_state.to(torch.bfloat16)
    over = dict(scale=scale) | (dict(lower_bound=lower_bound) if gate == "lower_bound" else {})
    state_out = dict(final_state_dtype=torch.bfloat16) if bf16_final else {}
    # On unless turned off (hypothesis examples share no fixtures).
    with mock.patch.object(kda.cuda, "TURNED_OFF", False), kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs(**over, **state_out))
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(**over, **state_out))
    # sequences of at most dispatch.CHUNK_DECODE_TOKENS go to the decode kernel where it takes them
    assert ("cuda:decode" if kda.cuda._decodes(p) else "cuda:recurrence") in events, events
    assert ht.dtype == (torch.bfloat16 if bf16_final else torch.float32)
    o_tr, ht_tr = kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs(**over, **state_out))
    c64 = case.to(torch.float64)  # a bf16 initial state converts exactly
    o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), backend="torch", **c64.kwargs(**over))
    assert_close_fp64(o, o_ref, 5e-3, "o")
    assert_close_fp64(ht, ht_ref, 5e-3, "final state")
    if sum(seq_lens) >= 256:  # tiny problems: both errors are noise-sized
        assert rel(o, o_ref) <= 1.1 * rel(o_tr, o_ref) + 1e-4
        assert rel(ht, ht_ref) <= 1.1 * rel(ht_tr, ht_ref) + 1e-4


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("scale, neg_eigval", [(0.3, False), (None, True)])
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
def test_gpu_cuda_scale_and_beta_form_against_reference_directly(cuda_on, scale, neg_eigval, op):
    """A scale of the caller's and allow_neg_eigval (beta = 2 sigmoid, K1's and the decode
    kernel's beta_scale) on the CUDA chunk and decode paths, against reference.py's float64
    token loop called directly (the property test above draws neither allow_neg_eigval nor a
    yardstick independent of the API; added 2026-12-05 after a mutation audit, not yet run)."""
    decoding = op == "fused_recurrent_kda"  # (sequences in the decode kernel's range)
    case = cuda_case([40, 7] if decoding else [300, 77], 2, False, "lower_bound", False, True, seed=18)
    kw = case.kwargs(allow_neg_eigval=neg_eigval, **({} if scale is None else {"scale": scale}))
    if decoding:
        kw.pop("safe_gate")
    with kda.record_dispatch() as events:
        o, ht = getattr(kda, op)(*case.tensors(), backend="cuda", **kw)
    assert ("cuda:decode" if decoding else "cuda:recurrence") in events, events
    o_ref, ht_ref = fp64_direct(case, scale=scale, allow_neg_eigval=neg_eigval)
    assert_close_fp64(o, o_ref, 5e-3, "o")  # the bar of the property test above (bf16 inputs)
    assert_close_fp64(ht, ht_ref, 5e-3, "final state")


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_steep_lower_bound_takes_the_pairwise_rows(cuda_on):
    """lb = -12 (allowed with safe_gate=False): the fused gate can decay a 16-token chunk past
    2^-116, so K1 must test rows and take the pairwise form (with lb >= -5.02 it skips the
    test): still fp64-accurate."""
    case = cuda_case([700, 333], 2, True, "lower_bound", False, True, seed=12)
    case.g = (case.g.float() + 30.0).to(case.g.dtype)  # gate inputs near saturation: g ~ lb a token
    steep = dict(lower_bound=-12.0, safe_gate=False)
    o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs(**steep))
    c64 = case.to(torch.float64)
    o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), backend="torch", **c64.kwargs(**steep))
    assert_close_fp64(o, o_ref, 5e-3, "o")
    assert_close_fp64(ht, ht_ref, 5e-3, "final state")


def spy_launches(monkeypatch) -> list[str]:
    """The names of the kernels launched from here on, in order (the launches still happen)."""
    launched = []
    launch = loader.Kernels.launch

    def spy(self, name, *args, **kwargs):
        launched.append(name)
        return launch(self, name, *args, **kwargs)

    monkeypatch.setattr(loader.Kernels, "launch", spy)
    return launched


def run_poisoned(p, layout: bool, state_dtype: torch.dtype, label: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """K1 and K2 of ``p`` into NaN-filled outputs inside NaN guard bands: every output element
    written, nothing written outside them. ``(o, final state)``."""
    from kda.cuda.forward import run_stages, workspace_bytes

    o_buf, o, guard = guarded((1, p.T, p.HV, p.V), torch.bfloat16, "cuda")
    h_buf, ht, _ = guarded((p.N, p.HV, p.V, p.K) if layout else (p.N, p.HV, p.K, p.V), state_dtype, "cuda")
    run_stages(p, o, ht, torch.empty(workspace_bytes(p), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    assert not o.isnan().any() and not ht.isnan().any(), f"{label}some outputs were never written"
    for buf in (o_buf, h_buf):
        assert_bands_untouched(buf, guard, f"{label}the output")
    return o, ht


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("layout,state_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_gpu_cuda_writes_every_output_and_nothing_else(cuda_on, layout, state_dtype):
    case = cuda_case([0, 17, 1, 33, 300], 2, layout, "lower_bound", False, True, seed=5)
    case.initial_state = case.initial_state.to(state_dtype)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(final_state_dtype=state_dtype))
    o, ht = run_poisoned(p, layout, state_dtype)
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 5e-3, "o")
    assert_close_fp64(ht, ht_ref, 5e-3, "state")


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("layout,state_dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_gpu_cuda_k_split_keeps_the_state_bits_and_writes_every_output(cuda_on, monkeypatch, layout, state_dtype):
    """K2 with each V group's K split between two warps (KDA_CUDA_WARPS=2k2): the final state
    is the unsplit kernel's bit for bit (U is, as each warp adds its own half of S^T w^T to its
    partner's), the output within float32 summation order of it and as close to float64; every
    output written, nothing outside them; the split entry point is the one launched."""
    case = cuda_case([0, 17, 1, 33, 300, 1201], 2, layout, "lower_bound", False, True, seed=31)
    case.initial_state = case.initial_state.to(state_dtype)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(final_state_dtype=state_dtype))
    launched = spy_launches(monkeypatch)
    results = {}
    for w in ("2", "2k2"):
        monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", w)
        results[w] = run_poisoned(p, layout, state_dtype, f"{w}: ")
    assert launched.count("kda_recurrence_w2k2") == 1 and launched.count("kda_recurrence_w2") == 1, launched
    (o2, ht2), (o_split, ht_split) = results["2"], results["2k2"]
    assert torch.equal(ht_split, ht2)
    assert rel(o_split, o2) < 2e-3
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o_split, o_ref, 5e-3, "o")
    assert rel(o_split, o_ref) <= 1.05 * rel(o2, o_ref) + 1e-5


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("ctas", [1, 2])
@pytest.mark.parametrize("layout,state_dtype,with_state,lower_bound",
                         [(False, torch.float32, True, -5.0), (True, torch.bfloat16, True, -5.0),
                          (True, torch.float32, False, -5.0), (False, torch.float32, True, -0.5),
                          # K1's far entry point's twin (KDA_CUDA_FAR_WGMMA=1): a precomputed g
                          # (None) with steep steps, whose rows take the pairwise form, and lb = -8
                          (True, torch.float32, True, None), (False, torch.bfloat16, True, -8.0)])  # fmt: skip
def test_gpu_wgmma_recurrence_writes_every_output_and_matches_mma_and_fp64(
    cuda_on, monkeypatch, ctas, layout, state_dtype, with_state, lower_bound
):
    """The wgmma K2 (KDA_CUDA_WARPS=wgmma1 / wgmma2, with K1's twin storing its tiles for it):
    every output written and nothing else, on varlen with empty, one-token, partial and long
    sequences, both state layouts, float32 and bf16 states, with and without an initial state,
    and with lb = -0.5, where a chunk's state reaches far into the next ones (at lb = -5 a
    chunk decays by about e^-44, so the state carried between chunks barely shows in the
    results: a review, 2026-12-04); as accurate against float64 as the mma.sync K2 on the same
    inputs, and within 1e-3 of it (float32 accumulation order; run 121: 2e-6 at most). The far
    entry point's gates (a precomputed g with steep steps, lb = -8) take its own twin
    (kda_prepare_far_wgmma) under KDA_CUDA_FAR_WGMMA=1."""
    far = lower_bound is None or lower_bound < -5.0
    monkeypatch.setattr(kda.cuda, "FAR_WGMMA", far)
    gate = "precomputed" if lower_bound is None else "lower_bound"
    case = cuda_case([0, 17, 1, 33, 300, 1201], 2, layout, gate, False, with_state, seed=41 + ctas,
                     steep_steps=40 if lower_bound is None else 0)  # fmt: skip
    if with_state:
        case.initial_state = case.initial_state.to(state_dtype)
    kw = case.kwargs(final_state_dtype=state_dtype)
    if lower_bound is not None:
        kw.update(lower_bound=lower_bound, safe_gate=lower_bound >= abi.SAFE_LOWER_BOUND_MIN)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    launched = spy_launches(monkeypatch)
    results = {}
    for route in ("mma", f"wgmma{ctas}"):
        monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", route)
        results[route] = run_poisoned(p, layout, state_dtype, f"{route}: ")
    launched = [name for name in launched if name.startswith(("kda_prepare", "kda_recurrence"))]  # not the tables
    k1 = abi.PREPARE_FAR_KERNEL if far else abi.PREPARE_KERNEL
    assert launched[2:] == [abi.PREPARE_WGMMA_TWINS[k1], abi.wgmma_kernel_name(ctas)], launched
    assert launched[0] == k1 and not launched[1].startswith("kda_recurrence_wgmma"), launched
    (o_mma, ht_mma), (o_w, ht_w) = results["mma"], results[f"wgmma{ctas}"]
    assert rel(o_w, o_mma) < 1e-3 and rel(ht_w.float(), ht_mma.float()) < 1e-3
    o_ref, ht_ref = fp64_reference(case, **({} if lower_bound is None else {"lower_bound": lower_bound}))
    assert_close_fp64(o_w, o_ref, 5e-3, "o")
    assert_close_fp64(ht_w, ht_ref, 5e-3, "state")
    assert rel(o_w, o_ref) <= 1.02 * rel(o_mma, o_ref) + 1e-5
    assert rel(ht_w.double(), ht_ref) <= 1.02 * rel(ht_mma.double(), ht_ref) + 1e-5


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_gpu_wgmma_prepare_stores_kda_prepares_values_in_its_layout(cuda_on, monkeypatch, gate):
    """kda_prepare_wgmma is kda_prepare's arithmetic with other store addresses: its workspace,
    read through loader.workspace_views(wgmma=True), equals kda_prepare's field by field, bit
    for bit, on every real chunk; and kda_prepare_far_wgmma kda_prepare_far's (a precomputed g
    with steep steps, whose rows take the pairwise form; KDA_CUDA_FAR_WGMMA=1)."""
    from kda.cuda.forward import run_stages, workspace_bytes

    monkeypatch.setattr(kda.cuda, "FAR_WGMMA", gate == "precomputed")
    steep = 0 if gate == "lower_bound" else 30
    case = cuda_case([37, 0, 16, 200, 1], 3, False, gate, False, True, seed=43, steep_steps=steep)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    launched = spy_launches(monkeypatch)
    tables = chunk_tables(p)
    real = int(tables.chunk_offsets[-1])
    views = {}
    for route in ("mma", "wgmma1"):
        monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", route)
        ws = torch.full((workspace_bytes(p),), 255, dtype=torch.uint8, device="cuda")
        run_stages(p, torch.empty_like(p.v), torch.empty(p.state_shape, device="cuda"), ws)
        views[route] = loader.workspace_views(ws, tables.num_chunks, p.H, wgmma=route != "mma")
    k1 = abi.PREPARE_KERNEL if gate == "lower_bound" else abi.PREPARE_FAR_KERNEL
    assert [name for name in launched if name.startswith("kda_prepare")] == [k1, abi.PREPARE_WGMMA_TWINS[k1]], launched
    for name, x in views["mma"].items():
        assert torch.equal(views["wgmma1"][name][:real], x[:real]), name


@pytest.mark.gpu
@cuda_ready
def test_gpu_a_workspace_off_its_alignment_is_refused(cuda_on):
    """K1 may store its wgmma tiles by address bits (prepare.cu wgmma_step_store), which holds
    where the workspace starts on abi.WORKSPACE_ALIGN bytes: a view 64 bytes in is refused
    before K1 and K2 launch, and the aligned view runs."""
    from kda.cuda.forward import run_stages, workspace_bytes

    case = cuda_case([37, 16], 2, False, "lower_bound", False, True, seed=45)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    room = torch.empty(workspace_bytes(p) + abi.WORKSPACE_ALIGN, dtype=torch.uint8, device="cuda")
    o, ht = torch.empty_like(p.v), torch.empty(p.state_shape, device="cuda")
    with pytest.raises(ValueError, match=f"start on {abi.WORKSPACE_ALIGN} bytes"):
        run_stages(p, o, ht, room[64:])
    run_stages(p, o, ht, room[abi.WORKSPACE_ALIGN :])
    torch.cuda.synchronize()
    assert o.isfinite().all()


@pytest.mark.gpu
@cuda_ready
def test_gpu_wgmma_recurrence_runs_by_the_rule(cuda_on, switches):
    """Where two CTAs a (sequence, head) pair fill the SMs the call takes the wgmma K2 (the
    dispatch log says so, after the launch), as float64 says it should, a steep lower bound (K1's
    far entry point, through its twin) too; with too few heads, KDA_CUDA_WARPS=mma, or the steep
    bound under KDA_CUDA_FAR_WGMMA=0 it does not."""
    from kda.cuda.forward import WGMMA_MIN_FILL, sm_count

    switches("KDA_CUDA_WARPS", None)
    switches("KDA_CUDA_FAR_WGMMA", None)  # (the default: lb = -8 below takes the far entry point's twin)
    sms = sm_count(torch.cuda.current_device())
    for H, lower_bound, want in ((sms // 2, -5.0, "cuda:recurrence:wgmma1"), (sms, -5.0, "cuda:recurrence:wgmma2"),
                                 (int(WGMMA_MIN_FILL * sms) // 2 - 1, -5.0, None),
                                 (sms, -8.0, "cuda:recurrence:wgmma2")):  # fmt: skip
        case = cuda_case([40], H, True, "lower_bound", False, True, seed=44)
        kw = case.kwargs(lower_bound=lower_bound, safe_gate=lower_bound >= abi.SAFE_LOWER_BOUND_MIN)
        with kda.record_dispatch() as events:
            o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
        wgmma = [e for e in events if e.startswith("cuda:recurrence:")]
        assert wgmma == ([want] if want else []), (H, lower_bound, events)
        c64 = case.to(torch.float64)
        o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), backend="torch", **c64.kwargs(lower_bound=lower_bound,
                                      safe_gate=lower_bound >= abi.SAFE_LOWER_BOUND_MIN))  # fmt: skip
        assert_close_fp64(o, o_ref, 5e-3, "o")
        assert_close_fp64(ht, ht_ref, 5e-3, "state")
    switches("KDA_CUDA_FAR_WGMMA", "0")
    case = cuda_case([40], sms, True, "lower_bound", False, True, seed=46)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs(lower_bound=-8.0, safe_gate=False))
    assert not [e for e in events if e.startswith("cuda:recurrence:")], events
    switches("KDA_CUDA_WARPS", "mma")
    case = cuda_case([40], sms, True, "lower_bound", False, True, seed=45)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
    assert not [e for e in events if e.startswith("cuda:recurrence:")], events


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("gate,steep", [("lower_bound", 0), ("precomputed", 300)])
def test_gpu_cuda_strict_causality(cuda_on, gate, steep):
    """Also with steps of g = -50, where some rows of a chunk take prepare's pairwise form:
    the form of a row must not depend on later rows."""
    case = cuda_case([4099], 2, False, gate, False, True, seed=6, steep_steps=steep)
    assert_strictly_causal(case, "cuda", (4097, 4000, 17))


@pytest.mark.gpu
@cuda_ready
def test_gpu_auto_picks_cuda_and_the_kernels_run(cuda_on):
    case = cuda_case([100, 40], 2, True, "lower_bound", False, True, seed=7)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert events == ["chunk_kda -> cuda", "cuda:prepare", "cuda:recurrence"]


@pytest.mark.gpu
@cuda_ready
def test_gpu_explicit_cuda_on_unsupported_call_names_the_feature(cuda_on):
    case = make_case(T=64, H=2, K=64, V=64, dtype=torch.bfloat16, device="cuda", seed=8)
    with pytest.raises(kda.BackendUnavailableError, match="head dims"):
        kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize(
    "width, paired", [(None, True), ("2", True), ("4", True), ("wgmma2", False), ("wgmma2", True), ("wgmma1", True)]
)
def test_gpu_cuda_shared_runs_equal_separate_calls_bit_for_bit(cuda_on, monkeypatch, width, paired):
    """kda.cuda.forward.chunk_forward_runs (the split's transition runs on one K1, the second with
    v taken as zeros without reading v): each call's outputs are those of the call alone with its
    v, bit for bit (K2 reads the same workspace either way, and a zero v tile is zeros). At the
    rule's width (K split, for these few pairs) and at the two unsplit ones; on the wgmma K2 a
    launch a run (``paired`` off) and both runs in one launch (forward.runs_kind), at either count
    of CTAs an SM."""
    from kda.cuda import forward
    from kda.cuda.forward import chunk_forward_runs

    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", width)
    monkeypatch.setattr(kda.cuda, "PAIRED_RUNS", paired)

    case = cuda_case([0, 17, 1000, 3000], 4, True, "lower_bound", False, True, seed=23)
    q, k, v, g, beta = case.tensors()
    kw = case.kwargs()
    runs = [(v, case.initial_state), (torch.zeros_like(v), torch.randn_like(case.initial_state))]
    problems = [
        checked_problem(kda.chunk_kda, q, k, v_run, g, beta, **(kw | {"initial_state": h0})) for v_run, h0 in runs
    ]
    problems[1].v = v  # the second run's v is zeros, read as such (v_zero): its problem's v is a template
    outputs = forward._outputs

    def poisoned(p):  # every element unwritten stays NaN, which no comparison below passes
        o, ht = outputs(p)
        return o.fill_(float("nan")), ht.fill_(float("nan"))

    monkeypatch.setattr(forward, "_outputs", poisoned)
    with kda.record_dispatch() as events:
        got = chunk_forward_runs(problems, v_zero=[False, True])
    monkeypatch.setattr(forward, "_outputs", outputs)
    wgmma = [f"cuda:recurrence:{width}"] if width in forward.WGMMA_OVERRIDES else []
    if wgmma and paired:  # one K2 launch for both runs
        assert events == ["cuda:prepare", "cuda:recurrence:runs", *wgmma], events
    else:
        assert events == ["cuda:prepare", "cuda:recurrence", *wgmma, "cuda:recurrence", *wgmma], events
    for (o, ht), (v_run, h0) in zip(got, runs, strict=True):
        o_alone, ht_alone = kda.chunk_kda(q, k, v_run, g, beta, backend="cuda", **(kw | {"initial_state": h0}))
        assert torch.equal(o, o_alone) and torch.equal(ht, ht_alone)


def one_sequence_case(T, H, layout, with_state, state_dtype, seed, varlen=False):
    """One sequence of T tokens, batched (B = 1) or as varlen with cu_seqlens [0, T] (and its host copy)."""
    case = make_case(seq_lens=[T] if varlen else None, B=1, T=T, H=H, K=128, V=128, dtype=torch.bfloat16,
                     gate="lower_bound", state_v_first=layout, with_state=with_state, device="cuda",
                     seed=seed)  # fmt: skip
    if with_state:
        case.initial_state = case.initial_state.to(state_dtype)
    kw = case.kwargs(final_state_dtype=state_dtype)
    if varlen:
        kw["cu_seqlens_cpu"] = case.cu_seqlens.cpu()
    return case, kw


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize(
    "T,H,blocks,layout,state_dtype,with_state,varlen,final,warps",
    [(100, 2, 3, False, torch.float32, True, False, True, None),
     (1000, 4, 4, True, torch.bfloat16, True, True, True, None),
     (4096, 1, 8, True, torch.float32, False, False, True, None),
     (777, 3, 100, False, torch.bfloat16, True, True, True, "mma"),
     (1000, 2, 5, True, torch.float32, False, False, False, None),
     (1000, 2, 5, True, torch.float32, True, False, True, "mma")],
)  # fmt: skip
def test_gpu_cuda_time_blocks_equal_the_uncut_call_bit_for_bit(
    cuda_on, switches, T, H, blocks, layout, state_dtype, with_state, varlen, final, warps
):
    """K1 beside K2 in time blocks (KDA_CUDA_BLOCKS), batched and as one varlen sequence: the
    blocks' chunks are the uncut call's and
    K2 carries its float32 state across them as within one block, so o and the final state are the
    uncut call's on the same K2 bit for bit, read on the current stream straight after the call
    (which must wait for the recurrence stream). The blocks take the wgmma K2 at one CTA an SM
    (forward.recurrence_kind's ``blocked``; the uncut call is pinned to it) unless ``warps`` pins the mma.sync
    one for both. Through the test hook into NaN-poisoned outputs inside guard bands: every
    element written, nothing outside; and within the fp64 bound."""
    from kda.cuda.forward import block_bounds, run_blocks

    case, kw = one_sequence_case(T, H, layout, with_state, state_dtype, seed=40 + T, varlen=varlen)
    kw["output_final_state"] = final
    switches("KDA_CUDA_BLOCKS", "1")
    switches("KDA_CUDA_WARPS", warps or "wgmma1")
    with kda.record_dispatch() as uncut_events:
        o_uncut, ht_uncut = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    assert not any(e.startswith("cuda:blocks") for e in uncut_events), uncut_events
    switches("KDA_CUDA_BLOCKS", str(blocks))
    switches("KDA_CUDA_WARPS", warps)
    count = len(block_bounds(T, blocks))
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    k2_events = ["cuda:recurrence"] if warps else ["cuda:recurrence", "cuda:recurrence:wgmma1"]
    assert events == [
        "chunk_kda -> cuda",
        f"cuda:blocks:{count}",
        *["cuda:prepare"] * count,
        *k2_events * count,
    ]
    assert torch.equal(o, o_uncut)
    assert (ht is None and ht_uncut is None) if not final else torch.equal(ht, ht_uncut)

    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    o_buf, o_poisoned, guard = guarded((1, T, H, 128), torch.bfloat16, "cuda")
    h_buf, ht_poisoned, _ = guarded(p.state_shape, state_dtype, "cuda")
    run_blocks(p, o_poisoned, ht_poisoned if final else None, blocks)
    assert_bands_untouched(o_buf, guard, "o")
    assert torch.equal(o_poisoned, o_uncut), "an output was not written"
    if final:
        assert_bands_untouched(h_buf, guard, "the state")
        assert torch.equal(ht_poisoned, ht_uncut), "a state element was not written"
    # (without a final state no state buffer reaches run_blocks, so a check of h_buf there could not
    # fail: removed 2026-12-06; test_cuda_launch.py checks that the last block then stores no state)
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 5e-3, "o")
    if final:
        assert_close_fp64(ht, ht_ref, 5e-3, "final state")


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_time_blocks_step_aside_under_graph_capture(cuda_on, switches):
    """A capture takes the uncut launch even where KDA_CUDA_BLOCKS asks for blocks (the second
    stream's fork is not captured), on the K2 the blocks take (the wgmma one, where the fill rule
    alone would take the mma.sync one for two heads), and its replay equals the eager, blocked
    call bit for bit."""
    switches("KDA_CUDA_BLOCKS", "4")
    case, kw = one_sequence_case(1000, 2, True, True, torch.float32, seed=48, varlen=True)
    with kda.record_dispatch() as eager_events:
        eager, _ = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    assert "cuda:blocks:4" in eager_events, eager_events
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with kda.record_dispatch() as captured_events, torch.cuda.graph(graph, stream=stream):
        captured, _ = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    assert not any(e.startswith("cuda:blocks") for e in captured_events), captured_events
    assert "cuda:recurrence:wgmma1" in captured_events and "cuda:recurrence:wgmma1" in eager_events
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_long_sequence_takes_time_blocks_by_the_rule_from_several_threads(cuda_on, switches):
    """A sequence of PIPELINE_MIN_TOKENS with two heads takes the blocks by the rule (the dispatch
    log says how many) on the wgmma K2, equals the uncut call on that K2 bit for bit, and so do
    calls from two threads at once, each on its own stream (each stream has its own recurrence
    stream)."""
    import threading

    from kda.cuda.forward import PIPELINE_BLOCKS, PIPELINE_MIN_TOKENS

    case, kw = one_sequence_case(PIPELINE_MIN_TOKENS, 2, True, True, torch.float32, seed=47, varlen=True)
    switches("KDA_CUDA_BLOCKS", "1")
    switches("KDA_CUDA_WARPS", "wgmma1")
    o_uncut, ht_uncut = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    switches("KDA_CUDA_BLOCKS", None)
    switches("KDA_CUDA_WARPS", None)
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), **kw)
    assert f"cuda:blocks:{PIPELINE_BLOCKS}" in events, events
    assert events.count("cuda:recurrence:wgmma1") == PIPELINE_BLOCKS, events
    assert torch.equal(o, o_uncut) and torch.equal(ht, ht_uncut)
    results, errors = {}, []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    results[i] = kda.chunk_kda(*case.tensors(), **kw)
                    ok = torch.equal(results[i][0], o_uncut) and torch.equal(results[i][1], ht_uncut)
                    errors.extend([] if ok else [f"thread {i} differs from the uncut call"])
            stream.synchronize()
        except Exception as error:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(repr(error))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    assert len(results) == 2


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("width", [None, "wgmma2"])
def test_gpu_cuda_graph_capture_replays_the_eager_result(cuda_on, monkeypatch, width):
    """Both K2 kinds: the rule's (four heads: the mma.sync K2) and the wgmma one forced, and the
    dispatch log shows which ran in each of the three calls (eager, warm-up, capture)."""
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", width)
    with kda.record_dispatch() as events:
        assert_graph_replays_eager(cuda_case([1000], 4, False, "lower_bound", False, True, seed=9), "cuda")
    assert events.count("cuda:recurrence") == 3, events
    wgmma = [e for e in events if e.startswith("cuda:recurrence:wgmma")]
    assert wgmma == (["cuda:recurrence:wgmma2"] * 3 if width == "wgmma2" else []), events


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_stream_workspace_is_reused_in_stream_order_and_never_captured(cuda_on):
    """Small workspaces are kept per stream: calls with different inputs queued back to back
    on one stream each give their own result; a capture allocates its own workspace."""
    from kda.cuda import forward, loader

    cases = [cuda_case([200, 64], 2, True, "lower_bound", False, True, seed=s) for s in (15, 16)]
    kws = [dict(c.kwargs(), cu_seqlens_cpu=c.cu_seqlens.cpu()) for c in cases]
    expected = []
    for case, kw in zip(cases, kws):
        expected.append(kda.chunk_kda(*case.tensors(), backend="cuda", **kw))
        torch.cuda.synchronize()
    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    kept = forward._workspaces[key]
    results = [kda.chunk_kda(*cases[i % 2].tensors(), backend="cuda", **kws[i % 2]) for i in range(6)]
    torch.cuda.synchronize()
    assert forward._workspaces[key] is kept
    for i, (o, ht) in enumerate(results):
        assert torch.equal(o, expected[i % 2][0]) and torch.equal(ht, expected[i % 2][1]), f"call {i}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture stream gets a kept workspace of its own
        kda.chunk_kda(*cases[1].tensors(), backend="cuda", **kws[1])
    torch.cuda.current_stream().wait_stream(side)
    kept_before = dict(forward._workspaces)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured, _ = kda.chunk_kda(*cases[0].tensors(), backend="cuda", **kws[0])
    captured_workspace = loader.kernels().params.workspace  # the block of the captured launches
    assert forward._workspaces == kept_before
    assert captured_workspace not in {w.data_ptr() for w in kept_before.values()}, "a capture used a kept workspace"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected[0][0])


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_runs_from_a_fresh_thread(cuda_on):
    """A thread that has made no CUDA runtime call of its own (everything it needs is cached)
    still launches: the backend makes the primary context current for it."""
    import threading

    case = cuda_case([300, 40], 2, True, "lower_bound", False, True, seed=14)
    kw = dict(case.kwargs(), cu_seqlens_cpu=case.cu_seqlens.cpu())
    o_main, _ = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)
    result = {}

    def work():
        result["o"] = kda.chunk_kda(*case.tensors(), backend="cuda", **kw)[0]
        torch.cuda.synchronize()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert torch.equal(result["o"], o_main)


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_prepare_matches_triton_prepare(cuda_on, monkeypatch):
    """K1 alone against the GPU-verified Triton prepare stage, field by field: when the
    end-to-end check fails, this says whether K1 or K2 is at fault. (The mma.sync K2's layout,
    which workspace_views reads by default, whatever KDA_CUDA_WARPS says.)"""
    from kda.cuda.forward import run_stages, workspace_bytes
    from kda.triton.prepare import prepare_chunks

    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", "mma")

    case = cuda_case([37, 0, 16, 200], 2, False, "lower_bound", False, True, seed=10)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    ws = torch.empty(workspace_bytes(p), dtype=torch.uint8, device="cuda")
    run_stages(p, torch.empty_like(p.v), torch.empty(p.state_shape, device="cuda"), ws)
    tables = chunk_tables(p)
    real = int(tables.chunk_offsets[-1])  # the slots past them hold no chunk: neither stage writes them
    got = {n: x[:real] for n, x in loader.workspace_views(ws, tables.num_chunks, p.H).items()}
    want = {n: x[:real] for n, x in prepare_chunks(p, tables, torch.float32, "ieee").items()}
    inverse_beta = got["inverse_beta_hi"].float() + got["inverse_beta_lo"].float()
    for name, x, ref, bar in (
        ("q_decayed", got["q_decayed"], want["q_decayed"], 5e-3),
        ("k_restored", got["k_restored"], want["k_restored"], 5e-3),
        ("w", got["w"], want["w"], 5e-3),
        ("M", got["M"], want["M"], 5e-3),
        ("inverse_beta", inverse_beta, want["inverse_beta"], 1e-4),
        ("gamma", got["gamma"], want["gamma"], 1e-6),
    ):
        assert rel(x.float(), ref.float()) <= bar, f"{name}: {rel(x.float(), ref.float()):.2e}"


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_recurrence_matches_triton_on_the_same_workspace(cuda_on, monkeypatch):
    """K2 alone: fed the Triton prepare's operands (in K1's layout), it must give the Triton
    recurrence's output, up to the bf16 hi/lo split of inverse_beta. (The mma.sync K2, whose
    layout the workspace is filled in, whatever KDA_CUDA_WARPS says.)"""
    from kda.cuda.forward import run_stages, workspace_bytes
    from kda.triton import chunk_forward as triton_forward
    from kda.triton.prepare import prepare_chunks

    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", "mma")

    case = cuda_case([37, 0, 16, 200], 2, True, "lower_bound", False, True, seed=11)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    tables = chunk_tables(p)
    ops = prepare_chunks(p, tables, torch.bfloat16, "tf32")
    hi = ops["inverse_beta"].to(torch.bfloat16)
    fields = dict(ops, inverse_beta_hi=hi, inverse_beta_lo=(ops["inverse_beta"] - hi.float()).to(torch.bfloat16),
                  M=ops["M"].to(torch.bfloat16))  # fmt: skip
    ws = torch.empty(workspace_bytes(p), dtype=torch.uint8, device="cuda")
    blocks = ws[: tables.num_chunks * p.H * loader.WORKSPACE_BYTES].view(tables.num_chunks, p.H, -1)
    for name, (offset, _, shape) in loader.WORKSPACE_FIELDS.items():
        field = loader.swizzle_tiles(fields[name]) if shape == (16, 128) else fields[name]
        raw = field.contiguous().view(torch.uint8).view(tables.num_chunks, p.H, -1)
        blocks[:, :, offset : offset + raw.shape[-1]] = raw
    o, ht = run_stages(p, torch.empty_like(p.v), torch.empty(p.state_shape, device="cuda"), ws, run_prepare=False)
    o_tr, ht_tr = triton_forward(p)
    assert rel(o, o_tr) <= 2e-3 and rel(ht, ht_tr) <= 2e-3, (rel(o, o_tr), rel(ht, ht_tr))
