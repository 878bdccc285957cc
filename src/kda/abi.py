"""What Python and the CUDA kernels share, written once: the chunk and head sizes, the
numeric limits, the ``Params`` block both kernels take and its flag bits, the per-(chunk,
head) workspace layout, the launch constants and the recurrence's shared memory per width.

The build turns this file into the header the kernels include (``kda_abi.h``, written by
``python src/kda/abi.py <path>`` from CMakeLists.txt; kda_cuda.cuh includes it); the loader,
validation and the Triton kernels import the same names. So nothing here has a hand copy
to keep in step, and a change here reaches both sides on the next build. Pure Python, no
imports beyond the standard library: it runs in the build's isolated environment.
"""

from __future__ import annotations

import hashlib
import math
import sys

CHUNK = 16  # tokens per chunk
HEAD_DIM = 128  # K = V on the CUDA path (others go to Triton)
# Decays are applied as 2^x with x clamped here: 2^116 * |k| stays far below float32's 2^128.
EXP2_LIMIT = 116.0
L2NORM_EPS = 1e-6  # q / sqrt(sum q^2 + eps), k likewise
# safe_gate's lower bound: from lb >= this, no 16-token row of the lower-bound gate decays past
# 2^-EXP2_LIMIT (16 * 5 * log2(e) = 115.4 < 116), so the kernels skip the far-row path.
SAFE_LOWER_BOUND_MIN = -5.0
# The training forward saves the state entering every CHECKPOINT_CHUNKS-th chunk of each
# sequence (float32, [rows, HV, V, K]); the backward recomputes the states in between, each
# chunk from its own checkpoint (at most CHECKPOINT_CHUNKS - 1 chunk steps). Four chunks
# (64 tokens, fla's chunk) keep a quarter of the per-chunk states between forward and
# backward. docs/algorithm.md section 8 has the account. Triton's recurrence and the CUDA K2
# both write them.
CHECKPOINT_CHUNKS = 4
assert -SAFE_LOWER_BOUND_MIN * CHUNK * math.log2(math.e) < EXP2_LIMIT
# A log-decay below this is a hard reset of its key channel (spec section 9): exp(-104) is under
# half of float32's smallest subnormal, so float32 rounds any decay through such a step to 0,
# as for g = -inf. (reference.py says how the chunk forms keep it exact.)
HARD_RESET = -104.0
assert math.exp(HARD_RESET) < 2.0**-150

# Params::flags bits, in order (bit i is the i-th name). C names: kGateLowerBound, kHasALog, ...
FLAG_NAMES = (
    "gate_lower_bound",  # g holds raw gate activations: g = lb * sigmoid(exp(A_log) (g + dt_bias))
    "has_A_log",
    "has_dt_bias",
    "l2norm",
    "beta_sigmoid",
    "has_h0",
    "store_ht",
    "state_v_first",  # states are [N, HV, V, K]; otherwise [N, HV, K, V]
    "g_float32",  # g is float32 (else bfloat16)
    "beta_float32",  # beta is float32 (else bfloat16)
    "h0_bfloat16",  # the initial state is bfloat16 (else float32); carried in float32
    "ht_bfloat16",  # the final state is stored in bfloat16 (else float32)
    # the decode kernel's (DecodeParams) and the tables builder's (TablesParams):
    "varlen",  # sequences are cu_seqlens spans (else B sequences of `tokens` tokens each)
    # the decode kernel's only:
    "indices_int64",  # slot indices are int64 (else int32)
    "accepted_int64",  # num_accepted_tokens is int64 (else int32)
    # the chunk kernels' (Params) only:
    "store_checkpoints",  # K2 writes the training forward's checkpoints (CHECKPOINT_CHUNKS)
    "v_zero",  # K2 takes v as zeros and reads none of it (the segment split's P run, kda.transitions)
    # the tables builder's (TablesParams) only:
    "rank_by_length",  # seq_order longest sequence first (else in order); only up to ORDER_MAX sequences
    "cu_seqlens_int32",  # cu_seqlens is int32 (else int64)
)
FLAGS = {name: 1 << bit for bit, name in enumerate(FLAG_NAMES)}

# kda::Params, passed by value to both kernels: every field 8 bytes, so ctypes mirrors it
# with no padding rules. (name, C type, Python kind: "ptr", "i64" or "f64").
PARAMS = (
    ("q", "const __nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("k", "const __nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("v", "const __nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("g", "const void*", "ptr"),  # [T_total, H, 128], bf16 or fp32 (g_float32)
    ("beta", "const void*", "ptr"),  # [T_total, H], bf16 or fp32 (beta_float32)
    ("A_log", "const float*", "ptr"),  # [H]
    ("dt_bias", "const float*", "ptr"),  # [H, 128]
    ("h0", "const void*", "ptr"),  # [N, H, 128, 128] fp32 or bf16 (h0_bfloat16)
    ("ht", "void*", "ptr"),  # [N, H, 128, 128] fp32 or bf16 (ht_bfloat16)
    ("o", "__nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("workspace", "unsigned char*", "ptr"),  # [num_chunks, H, WORKSPACE_BYTES]
    ("seq_offsets", "const int64_t*", "ptr"),  # [N + 1] token offsets
    ("chunk_offsets", "const int64_t*", "ptr"),  # [N + 1] first global chunk of each sequence
    ("chunk_seq", "const int64_t*", "ptr"),  # [num_chunks] sequence of each chunk
    ("seq_order", "const int64_t*", "ptr"),  # [N * H] (sequence, head) pairs, longest sequence first
    ("checkpoints", "float*", "ptr"),  # [rows, H, 128 (V), 128 (K)] fp32 (store_checkpoints), or null
    ("checkpoint_offsets", "const int64_t*", "ptr"),  # [N + 1] first checkpoint row of each sequence
    ("num_chunks", "int64_t", "i64"),
    ("num_seqs", "int64_t", "i64"),
    ("heads", "int64_t", "i64"),
    ("flags", "int64_t", "i64"),
    ("scale", "double", "f64"),
    ("lower_bound", "double", "f64"),
    ("beta_scale", "double", "f64"),  # 1, or 2 with allow_neg_eigval
)

# kda::DecodeParams, the decode kernel's block (decode.cu), mirrored the same way: one token
# loop per (sequence, value head, V slice), the state through a pool of `pool_slots` slots.
DECODE_PARAMS = (
    ("q", "const __nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("k", "const __nv_bfloat16*", "ptr"),  # [T_total, H, 128]
    ("v", "const __nv_bfloat16*", "ptr"),  # [T_total, HV, 128]
    ("g", "const void*", "ptr"),  # [T_total, HV, 128], bf16 or fp32 (g_float32)
    ("beta", "const void*", "ptr"),  # [T_total, HV], bf16 or fp32 (beta_float32)
    ("A_log", "const float*", "ptr"),  # [HV]
    ("dt_bias", "const float*", "ptr"),  # [HV, 128]
    ("h0", "const void*", "ptr"),  # [P, HV, 128, 128] in the state dtype (the pool, or initial states)
    ("ht", "void*", "ptr"),  # [P, HV, 128, 128] in the state dtype (the pool, or final states)
    ("o", "__nv_bfloat16*", "ptr"),  # [T_total, HV, 128]
    ("seq_offsets", "const int64_t*", "ptr"),  # [N + 1] token offsets (varlen)
    ("indices", "const void*", "ptr"),  # [N] or [N, index_cols] slots, int32 or int64 (indices_int64)
    ("accepted", "const void*", "ptr"),  # [N] accepted tokens (2-D indices), int32 or int64, or null
    ("tokens", "int64_t", "i64"),  # tokens per sequence (batched) or in all (varlen)
    ("num_seqs", "int64_t", "i64"),
    ("pool_slots", "int64_t", "i64"),  # P: a slot outside [0, P) is read as zeros and never written
    ("heads", "int64_t", "i64"),  # H (q, k)
    ("value_heads", "int64_t", "i64"),  # HV (v, g, beta, states), a multiple of H
    ("index_cols", "int64_t", "i64"),  # S of 2-D indices (1 otherwise)
    ("index_mode", "int64_t", "i64"),  # 0: slot n; 1: indices[n]; 2: indices[n, t] (read at accepted - 1)
    ("flags", "int64_t", "i64"),
    ("scale", "double", "f64"),
    ("lower_bound", "double", "f64"),
    ("beta_scale", "double", "f64"),
)

# kda::TablesParams, the block of the CUDA path's chunk-tables builder (prepare.cu
# kda_build_tables; kda.tables says what each table holds). A CTA's role follows from its
# index: CTA 0 writes the offsets tables, the next ones chunk_seq for TABLES_SLOTS slots each,
# the last ones seq_order for TABLES_SEQS sequences each (tables_grid).
TABLES_PARAMS = (
    ("cu_seqlens", "const void*", "ptr"),  # [N + 1] int64, or int32 (cu_seqlens_int32); null when batched
    ("seq_offsets", "int64_t*", "ptr"),  # [N + 1]
    ("chunk_offsets", "int64_t*", "ptr"),  # [N + 1]
    ("chunk_seq", "int64_t*", "ptr"),  # [num_chunks]
    ("seq_order", "int64_t*", "ptr"),  # [N * H]
    ("checkpoint_offsets", "int64_t*", "ptr"),  # [N + 1]
    ("num_chunks", "int64_t", "i64"),  # chunk slots (kda.tables.chunk_slots)
    ("num_seqs", "int64_t", "i64"),
    ("tokens", "int64_t", "i64"),  # T: offsets are clamped into [0, T]
    ("tokens_each", "int64_t", "i64"),  # tokens of each sequence when batched (unused when varlen)
    ("heads", "int64_t", "i64"),
    ("flags", "int64_t", "i64"),  # varlen, rank_by_length, cu_seqlens_int32
)
TABLES_KERNEL = "kda_build_tables"
TABLES_THREADS = 256
TABLES_SLOTS = 2048  # chunk slots a CTA of the builder owns
TABLES_SEQS = 64  # sequences a CTA of the builder orders
# The longest-first order of the CUDA recurrence's schedule is ranked for up to this many
# sequences (the ranking is quadratic; the builder holds their lengths in shared memory); more
# sequences fill the GPU whatever their order, so beyond it they are taken as they come.
ORDER_MAX = 4096


def tables_grid(num_chunks: int, num_seqs: int) -> int:
    """CTAs of kda_build_tables: one for the offsets tables, then the slot and sequence blocks."""
    return 1 + -(-num_chunks // TABLES_SLOTS) + -(-num_seqs // TABLES_SEQS)


DECODE_THREADS = 128  # threads of a decode CTA (one per K index in the token prologue)
# V columns of a decode CTA (one entry point each and state dtype): the state slice [128, BV]
# it stages in shared memory, BV x 128 x (4 or 2) bytes (128: the whole head).
DECODE_COLUMNS = (32, 64, 128)


# (state read, state written): one dtype, or a bf16 state written back in float32 (a plain call's
# default final state; Triton's decode kernel ran those until 2026-12-07)
DECODE_STATE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"))


def decode_kernel_name(state_dtype: str, v_first: bool, columns: int, final_dtype: str | None = None) -> str:
    """The decode entry point for a state dtype (and the final state's, where it differs: bf16
    read, float32 written), layout and CTA width (decode.cu defines each)."""
    widened = "_to_f32" if final_dtype not in (None, state_dtype) else ""
    dtype = "bf16" if state_dtype == "bfloat16" else "f32"
    return f"kda_decode_{dtype}{widened}_{'vk' if v_first else 'kv'}_c{columns}"


# The workspace of one (chunk, head), written by prepare and read once by the recurrence (one
# bulk copy into shared memory): (name, dtype, shape), stored back to back in this order.
# The [16, 128] tiles are stored swizzled for the recurrence's ldmatrix reads (tile_offset).
WORKSPACE = (
    ("q_decayed", "bfloat16", (CHUNK, HEAD_DIM)),  # scale * q * exp(G)
    ("w", "bfloat16", (CHUNK, HEAD_DIM)),  # (I + A)^-1 Diag(beta) K~
    ("k_restored", "bfloat16", (CHUNK, HEAD_DIM)),  # k * exp(G_16 - G)
    ("inverse_beta_hi", "bfloat16", (CHUNK, CHUNK)),  # (I + A)^-1 Diag(beta), bf16 part
    ("inverse_beta_lo", "bfloat16", (CHUNK, CHUNK)),  # and the bf16 remainder
    ("M", "bfloat16", (CHUNK, CHUNK)),  # causal q.k scores with decay
    ("gamma", "float32", (HEAD_DIM,)),  # exp(G_16)
)
ITEM_BYTES = {"bfloat16": 2, "float32": 4}


def _layout() -> tuple[dict, int]:
    fields, offset = {}, 0
    for name, dtype, shape in WORKSPACE:
        fields[name] = (offset, dtype, shape)
        offset += ITEM_BYTES[dtype] * math.prod(shape)
    return fields, offset


WORKSPACE_FIELDS, WORKSPACE_BYTES = _layout()  # name -> (byte offset, dtype, shape); bytes per block
assert WORKSPACE_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes"
# A workspace (so each block, WORKSPACE_BYTES apart) starts on this many bytes, a cache line: K2's
# bulk copies of a block need 16 (kda.cuda.forward.workspace_address checks); K1's tile stores by
# address bits (prepare.cu's candidate KDA_K1_STORE_OFFSETS, off by default) need 128.
WORKSPACE_ALIGN = 128
assert WORKSPACE_BYTES % WORKSPACE_ALIGN == 0, "every block starts aligned where the workspace does"
assert WORKSPACE_FIELDS["inverse_beta_hi"][0] == 3 * CHUNK * HEAD_DIM * 2, "the three tiles lead the block"

PREPARE_THREADS = 128  # threads of a prepare CTA (one per K column)
# K1's entry points (prepare.cu): where no row of a chunk can decay past 2^-EXP2_LIMIT, and the
# other, with the per-row test, the clamp and the pairwise recompute (and ki in a tile of its own).
PREPARE_KERNEL, PREPARE_FAR_KERNEL = "kda_prepare", "kda_prepare_far"


def prepare_kernel_name(gate_lower_bound: bool, lower_bound: float) -> str:
    """K1's entry point for a gate: the lower-bound gate decays by at most |lb| a token, so with
    lb at or above -EXP2_LIMIT / (CHUNK log2 e) = -5.025 (safe_gate's lb >= -5 among them) no row of a
    chunk gets past the limit; a precomputed g may decay by any amount."""
    may_be_far = not gate_lower_bound or lower_bound * CHUNK * math.log2(math.e) < -EXP2_LIMIT
    return PREPARE_FAR_KERNEL if may_be_far else PREPARE_KERNEL


STAGES = 3  # recurrence pipeline stages; four measured the same (benchmarks/NOTES.md, 2026-11-30, commit 0f49568)
RECURRENCE_WIDTHS = (1, 2, 4)  # warps per recurrence CTA (16 V columns each): one entry point each
# The widths whose 16-column V groups also have an entry point with each group's K split between
# two warps (kda_recurrence_w{warps}k2: twice the consumer warps, for calls with few chains; one
# group split, eight CTAs a pair, was slower than the unsplit widths on every anchor, H200,
# 2026-12-04, run 79).
RECURRENCE_SPLIT_WIDTHS = (2,)
CHAIN_WIDTHS = (1, 2)  # the same for the training backward's reverse chain (recurrence.cu)

# K2 on warpgroup MMAs (recurrence.cu kda_recurrence_wgmma_c1, _c2; 2026-12-04): a CTA is one
# warpgroup (four consumer warps, 64 V rows, two CTAs a (sequence, head)) and a producer warp;
# wgmma reads K1's three [16, 128] tiles from shared memory in the 128-byte-swizzled layout
# that K1's twin entry point PREPARE_WGMMA_KERNEL stores them in (WGMMA_TILES), over the first
# 12 KB of the block; the rest of the block is WORKSPACE's. One entry point a count of CTAs an SM
# (its pipeline stages: shared memory and registers for that many).
PREPARE_WGMMA_KERNEL = "kda_prepare_wgmma"
# ... and the far entry point's twin (2026-12-05; kda.cuda.FAR_WGMMA): K1's entry point -> its twin
PREPARE_FAR_WGMMA_KERNEL = "kda_prepare_far_wgmma"
PREPARE_WGMMA_TWINS = {PREPARE_KERNEL: PREPARE_WGMMA_KERNEL, PREPARE_FAR_KERNEL: PREPARE_FAR_WGMMA_KERNEL}
WGMMA_THREADS = 160
WGMMA_STAGE_BYTES = 17408  # a workspace block + 16 v rows of 64 columns, padded by 16 B, to 1 KB
WGMMA_STAGES = {1: 6, 2: 4}  # CTAs an SM -> stages (at three, a step waited ~190 cycles: run 108)
# [w; q_decayed] as [32 rows, 128 columns] (K-major), then k_restored as [16 tokens, 128]
# (MN-major), each as two 64-column halves of [rows, 128 B] with 16-byte piece p of row r at
# p ^ (r % 8) (loader.sw128_tiles): name -> (byte offset, rows).
WGMMA_TILES = {"wq": (0, 2 * CHUNK), "kr": (2 * CHUNK * HEAD_DIM * 2, CHUNK)}


def wgmma_kernel_name(ctas_per_sm: int) -> str:
    return f"kda_recurrence_wgmma_c{ctas_per_sm}"


def wgmma_runs_kernel_name(ctas_per_sm: int) -> str:
    """The wgmma K2 of two runs on one K1 workspace in one launch (recurrence.cu
    recurrence_wgmma_runs: two Params blocks, the same shared memory as wgmma_kernel_name's)."""
    return f"kda_recurrence_wgmma_runs_c{ctas_per_sm}"


def wgmma_shared_bytes(ctas_per_sm: int) -> int:
    """Dynamic shared memory of a wgmma K2 CTA: 1 KB to align the stages (the swizzle atoms need
    1024-byte alignment), its stages, two [16, 16] bf16 output tiles a consumer warp."""
    return 1024 + WGMMA_STAGES[ctas_per_sm] * WGMMA_STAGE_BYTES + 4 * 2 * CHUNK * 16 * 2


# The training backward's state-products kernel (recurrence.cu kda_state_products): work items of
# one (checkpoint span of CHECKPOINT_CHUNKS chunks, head), one CTA an SM, PRODUCT_WARPS consumer
# warps of 16 V rows each (the whole head) and a producer warp, PRODUCT_STAGES pipeline stages.
PRODUCT_WARPS = HEAD_DIM // 16
PRODUCT_STAGES = 3
PRODUCT_ROW_BYTES = 2 * HEAD_DIM + 16  # a staged bf16 row of v or dO, padded by 16 bytes


def products_shared_bytes() -> int:
    """Dynamic shared memory of a state-products CTA: PRODUCT_STAGES x (a workspace block, 16
    rows each of v and dO, a dS block), the products' operands (S^T, U, dU hi and lo as MMA
    fragments, each warp's dgamma partials), a [16, 16] bf16 tile per warp for dV.
    recurrence.cu checks its layout against this at compile time."""
    stage = WORKSPACE_BYTES + 2 * CHUNK * PRODUCT_ROW_BYTES + 2 * HEAD_DIM * HEAD_DIM
    operands = 2 * HEAD_DIM * HEAD_DIM + 3 * PRODUCT_WARPS * CHUNK * CHUNK * 2 + PRODUCT_WARPS * HEAD_DIM * 4
    return PRODUCT_STAGES * stage + operands + PRODUCT_WARPS * CHUNK * 16 * 2


def recurrence_shared_bytes(warps: int, ksplit: int = 1) -> int:
    """Dynamic shared memory of a recurrence CTA of ``warps`` 16-column V groups, each group's K
    split among ``ksplit`` warps: STAGES x (a workspace block + 16 v rows of 16 * warps bf16
    columns, each row padded by 16 bytes) + a [16, 16] bf16 output tile per consumer warp + where
    K is split, the pairs' exchange (per group, two steps' buffers of 12 floats a lane for each
    warp of the pair). recurrence.cu checks its layout against this at compile time."""
    v_row_bytes = 16 * warps * 2 + 16
    exchange = 0 if ksplit == 1 else warps * 2 * ksplit * 12 * 32 * 4
    return STAGES * (WORKSPACE_BYTES + CHUNK * v_row_bytes) + warps * ksplit * CHUNK * 16 * 2 + exchange


def c_flag_name(name: str) -> str:
    """``has_A_log`` -> ``kHasALog``: each word's first letter raised, the rest kept."""
    return "k" + "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _block_struct(name: str, fields: tuple) -> list[str]:
    """A parameter block's C++ struct and the check that ctypes can mirror it (8-byte fields)."""
    return [
        f"struct {name} {{",
        *(f"  {ctype} {field};" for field, ctype, _ in fields),
        "};",
        f"constexpr int k{name}Fields = {len(fields)};",
        f'static_assert(sizeof({name}) == 8 * k{name}Fields, "{name}: 8-byte fields only (mirrored by ctypes)");',
    ]


def header() -> str:
    """The C++ header of everything above (namespace kda)."""
    lines = [
        "// Generated at build time from src/kda/abi.py (python src/kda/abi.py <this file>): do not edit.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <cuda_bf16.h>",
        "",
        "namespace kda {",
        "",
        f"constexpr int kChunk = {CHUNK};",
        f"constexpr int kHeadDim = {HEAD_DIM};",
        f"constexpr float kExp2Limit = {EXP2_LIMIT!r}f;",
        f"constexpr float kL2normEps = {L2NORM_EPS!r}f;",
        f"constexpr float kHardReset = {HARD_RESET!r}f;",
        f"constexpr int kPrepareThreads = {PREPARE_THREADS};",
        f"constexpr int kStages = {STAGES};",
        f"constexpr int kCheckpointChunks = {CHECKPOINT_CHUNKS};",
        "",
        "enum : int64_t {",
        *(f"  {c_flag_name(name)} = int64_t(1) << {bit}," for bit, name in enumerate(FLAG_NAMES)),
        "};",
        "",
        *_block_struct("Params", PARAMS),
        "",
        *_block_struct("DecodeParams", DECODE_PARAMS),
        f"constexpr int kDecodeThreads = {DECODE_THREADS};",
        "",
        *_block_struct("TablesParams", TABLES_PARAMS),
        f"constexpr int kTablesThreads = {TABLES_THREADS};",
        f"constexpr int kTablesSlots = {TABLES_SLOTS};",
        f"constexpr int kTablesSeqs = {TABLES_SEQS};",
        f"constexpr int kOrderMax = {ORDER_MAX};",
        "",
        "struct WorkspaceLayout {",
        *(f"  static constexpr int {name} = {offset};" for name, (offset, _, _) in WORKSPACE_FIELDS.items()),
        f"  static constexpr int bytes = {WORKSPACE_BYTES};",
        "};",
        "constexpr int kWorkspaceBytes = WorkspaceLayout::bytes;",
        f"constexpr int kWorkspaceAlign = {WORKSPACE_ALIGN};",
        "",
        f"constexpr int kProductWarps = {PRODUCT_WARPS};",
        f"constexpr int kProductStages = {PRODUCT_STAGES};",
        f"constexpr int kProductRowBytes = {PRODUCT_ROW_BYTES};",
        f"constexpr int kProductsSharedBytes = {products_shared_bytes()};",
        "",
        f"constexpr int kWgmmaThreads = {WGMMA_THREADS};",
        f"constexpr int kWgmmaStageBytes = {WGMMA_STAGE_BYTES};",
        *(f"constexpr int kWgmmaTiles{name.capitalize()} = {offset};" for name, (offset, _) in WGMMA_TILES.items()),
        "constexpr int wgmma_stages(int ctas_per_sm) {",
        "  return " + " : ".join(f"ctas_per_sm == {c} ? {n}" for c, n in WGMMA_STAGES.items()) + " : -1;",
        "}",
        "constexpr int wgmma_shared_bytes(int ctas_per_sm) {",
        "  return " + " : ".join(f"ctas_per_sm == {c} ? {wgmma_shared_bytes(c)}" for c in WGMMA_STAGES) + " : -1;",
        "}",
        "",
        "constexpr int recurrence_shared_bytes(int warps, int ksplit = 1) {",
        "  return "
        + " : ".join(
            [f"warps == {w} && ksplit == 1 ? {recurrence_shared_bytes(w)}" for w in RECURRENCE_WIDTHS]
            + [f"warps == {w} && ksplit == 2 ? {recurrence_shared_bytes(w, 2)}" for w in RECURRENCE_SPLIT_WIDTHS]
        )
        + " : -1;",
        "}",
        "",
        "}  // namespace kda",
        "",
    ]
    return "\n".join(lines)


# The build's stamp beside the fatbins: kernels built from another abi.py read parameter blocks
# and workspaces of another layout (wrong answers or illegal accesses, with no message), and
# nothing rebuilds an editable install's kernels after a pull (a review, 2026-12-07). The
# loader refuses a folder whose stamp is missing or differs from header_id().
HEADER_ID_FILE = "kda_abi.id"


def header_id() -> str:
    """A hash of :func:`header`: what the kernels were compiled against."""
    return hashlib.sha256(header().encode()).hexdigest()[:16]


if __name__ == "__main__":  # the build: python src/kda/abi.py <output header> [<stamp file>]
    with open(sys.argv[1], "w") as out:
        out.write(header())
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as out:
            out.write(header_id() + "\n")
