// K1, prepare: token-parallel, one CTA of 128 threads (4 warps) per (chunk, head).
//
// For its 16 tokens the CTA activates the inputs (gate, l2norm, beta sigmoid), takes the
// chunk-local cumulative log-decay G (base 2, anchored at the chunk start so no row depends
// on a later one), and writes the workspace of kda_cuda.cuh (kda-spec.md section 2;
// reference.prepare_chunk is the same computation in torch):
//
//   1. q, k, g rows -> shared memory (cp.async; rows past the sequence end zero-filled);
//      the row norms on the tensor cores (diagonals of Q Q^T and K K^T); then each thread
//      owns two adjacent channels for eight rows: gate, cumulative sum (the upper eight rows
//      add the lower eight's total, one shuffle), decayed operands, all in registers.
//   2. A = K~ K^-T in 3xTF32 (float32-level accuracy: its solve amplifies errors) and
//      M = Q~ K^-T in tf32 (it is stored in bf16), 16 x 16 over 128 channels on the tensor
//      cores, each warp a quarter of the channels; the partials are summed in shared memory.
//   3. inverse_beta = (I + A)^-1 Diag(beta) by forward substitution in float32, one column
//      per thread of the first half warp, and
//   4. w = inverse_beta K~ (16 x 128 over 16 tokens) on the tensor cores in 3xTF32.
//
// Exponents: A and M need exp(G_i - G_j), j <= i. The fast form factors it as
// (k_i exp(G_i)) . (k_j exp(-G_j)), with exp(-G_j) clamped at 2^116 (the lower-bound gate,
// lb >= -5, never reaches it: |G| <= 80 / ln 2 over 16 tokens; a precomputed g may). Row i
// only needs j <= i, whose -G_j <= -G_i, so a row whose own decay stays inside the limit is
// exact in the factored form; a row past it is recomputed in the pairwise form, exact at any
// depth. The choice is made per row from that row's own G: a later token never changes how
// an earlier row is computed, which keeps strict causality bit for bit. When the gate's
// lower bound rules such rows out (the common case), the entry point kda_prepare (kMayBeFar =
// false) drops the per-row test, the clamp and the recompute; kda_prepare_far keeps them.
#include <cub/block/block_scan.cuh>

#include "kda_cuda.cuh"

namespace kda {
namespace {

constexpr int kThreads = kPrepareThreads;  // one per K column (kda_abi.h)
// Row stride (floats) of the float32 operand tiles: 132 = 4 mod 32, so the (row g, column t)
// pattern of an MMA fragment load, g < 8, t < 4, hits 32 distinct banks.
constexpr int kPad = kHeadDim + 4;
constexpr int kRowPad = kChunk + 4;  // 20 floats: A's rows 16-byte aligned for float4 reads
// Element (row, col) of a raw bf16 tile (q, k, a bf16 g: [16, 128], rows of 256 bytes) as
// stored: its 16-byte piece col / 8 sits at piece (col / 8) ^ (row % 8) ^ 4 (row / 8), so that
//   - the eight rows of an ldmatrix read at one column land in eight different bank groups,
//   - the elementwise stage's reads of rows r (lanes 0-15) and r + 8 (lanes 16-31), 64 bytes
//     each, land in the two different halves of the banks, and
//   - a row's copies fill whole 128-byte lines.
// (ncu on the H200, 2026-12-04, run 132: with the rows padded to 272 bytes instead, the q and k
// copies took 2.6 times the shared-memory wavefronts of whole lines, and those reads and the g
// reads two.)
__host__ __device__ constexpr int raw_index(int row, int col) {
  return row * kHeadDim + ((((col >> 3) ^ (row & 7) ^ ((row & 8) >> 1))) << 3) + (col & 7);
}

// The bank of a 4-byte word (32 banks): the checks below model each access as the hardware
// serves it (4-byte reads a warp at a time, ldmatrix's eight rows of 16 bytes at a time).
constexpr int bank(int word) { return word % 32; }
constexpr unsigned kAllBanks = 0xffffffffu;

// raw_index's three properties, checked where the compiler sees it.
constexpr bool raw_index_conflict_free() {
  for (int row = 0; row < kChunk; ++row) {  // a row's pieces fill the row's 256 bytes
    unsigned pieces = 0;
    for (int p = 0; p < kHeadDim / 8; ++p) {
      const int at = raw_index(row, 8 * p);
      if (at / kHeadDim != row || at % 8 != 0) return false;
      pieces |= 1u << (at % kHeadDim / 8);
    }
    if (pieces != 0xffffu) return false;
    for (int half = 0; half < 2; ++half) {  // the copies: eight lanes (pieces 8 half ..) a 128-byte phase
      unsigned groups = 0;
      for (int p = 8 * half; p < 8 * half + 8; ++p) groups |= 1u << (raw_index(row, 8 * p) / 8 % 8);
      if (groups != 0xffu) return false;
    }
  }
  for (int base = 0; base < kChunk; base += 8)  // ldmatrix: eight rows at one piece
    for (int p = 0; p < kHeadDim / 8; ++p) {
      unsigned groups = 0;  // 16-byte bank groups (four banks each)
      for (int r = base; r < base + 8; ++r) groups |= 1u << (raw_index(r, 8 * p) / 8 % 8);
      if (groups != 0xffu) return false;
    }
  for (int warp = 0; warp < 4; ++warp)  // the elementwise stage (PairRows): rows r8 and r8 + 8, a word a lane
    for (int r8 = 0; r8 < 8; ++r8) {
      unsigned banks = 0;
      for (int lane = 0; lane < 32; ++lane)
        banks |= 1u << bank(raw_index(r8 + 8 * (lane / 16), 32 * warp + 2 * (lane % 16)) / 2);
      if (banks != kAllBanks) return false;
    }
  return true;
}
static_assert(raw_index_conflict_free(), "raw_index: every row whole, each access of the raw tiles on every bank once");

struct __align__(16) PrepareTiles {
  __nv_bfloat16 q[kChunk * kHeadDim];  // raw inputs as loaded, at raw_index
  __nv_bfloat16 k[kChunk * kHeadDim];
  union {  // raw g as loaded; once every thread has read g, G (far rows) or ki (see PrepareShared)
    float g32[kChunk][kHeadDim];
    __nv_bfloat16 g16[kChunk * kHeadDim];  // at raw_index
    float G[kChunk][kPad];  // cumulative log2-decay (only the pairwise rows read it)
  } g;
  // scale q exp(G): left operand of M. Warp w reads only its columns [32 w, 32 w + 32), and
  // then stores its partial A and M there, rows rotated (partial_offset).
  float qd[kChunk][kPad];
  float kd[kChunk][kPad];  // k exp(G): left operand of A, right operand of w
  float A[kChunk][kRowPad];  // strictly lower, row i times beta_i; then inverse_beta
  float M[kChunk][kChunk];
  float rq[kChunk], rk[kChunk], beta[kChunk];  // rq includes the scale
  unsigned far_rows;  // bit i: row i's decay passes the limit
};

// ki = k exp(min(-G, limit)), the right operand of A and M. Where no row can be far (the entry
// point kda_prepare), it takes the raw g tile's place, dead once the gate is in registers: 35.2 KB
// a CTA in place of 43.5 (both 0.5 KB less since the raw tiles lost their row padding for
// raw_index, 2026-12-04), so that six CTAs fit an SM's 228 KB (with the 1 KB it reserves a CTA)
// instead of five. The pairwise rows of kda_prepare_far read G there, so ki has its own tile.
template <bool kMayBeFar>
struct PrepareShared;
template <>
struct PrepareShared<false> : PrepareTiles {
  __device__ float (&ki())[kChunk][kPad] { return g.G; }
};
template <>
struct PrepareShared<true> : PrepareTiles {
  // alignas: the compiler lays a derived class's members into its base's tail padding (here
  // after far_rows, 4 mod 8 bytes), where ki's float2 stores faulted as misaligned (run 72).
  alignas(16) float ki_tile[kChunk][kPad];
  __device__ float (&ki())[kChunk][kPad] { return ki_tile; }
};
// (offsetof of a class with a base is conditionally supported; nvcc computes it and warns)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1427
static_assert(__builtin_offsetof(PrepareShared<true>, ki_tile) % 16 == 0, "ki's float2 and fragment accesses");
#pragma nv_diagnostic pop

// Byte offset of bf16 element (r, c) of a [rows, 128] tile as the wgmma K2 reads it
// (abi.WGMMA_TILES): two 64-column halves of [rows, 128 B], 16-byte piece p of row r at p ^ (r % 8).
__host__ __device__ constexpr int wgmma_tile_offset(int rows, int r, int c) {
  return (c >> 6) * rows * 128 + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// KDA_K1_STORE_OFFSETS=1 (a candidate, 2026-12-05: 1% of K1 on an H100 in run 146, where K1 is
// bound by memory; back from 8a84845 for an A/B on an H200, where it is not): kda_prepare_wgmma's tile
// stores addressed from one offset a thread, as below, and in every K1 entry point each warp's w
// tiles as constants; 0 (the default) keeps wgmma_tile_offset at every store and the tiles as
// runtime values. The same stores to the same places.
#ifndef KDA_K1_STORE_OFFSETS
#define KDA_K1_STORE_OFFSETS 0
#endif
// KDA_K1_A_TF32=1 (a candidate, 2026-12-05, off by default): A in one tf32 product, both operands
// rounded to nearest (as M's), in place of 3xTF32. The design had 3xTF32 there because
// the solve amplifies A's errors. On the CUDA path's modelled roundings against float64 (T = 1024,
// bf16 inputs, K = V = 128; the bench gate, a long memory, keys of cosine 0.92 to 0.9999, negative
// eigenvalues, the precomputed gate) o and the final state moved by -0.2% to +0.5%: the
// workspace's bf16 stores dominate (benchmarks/k1_products.py). A's splits go (two instructions
// an operand element) with two of its three MMAs, and it shares M's rounded right operand:
// kda_prepare_wgmma 1984 -> 1904 static instructions, 84 -> 68 HMMA, 80 registers, no spills.
// A NaN in k, g or beta reaches A's row through the guarded rounding of K~ (round_tf32).
#ifndef KDA_K1_A_TF32
#define KDA_K1_A_TF32 0
#endif
// In a wgmma tile the swizzle XORs a row's 16-byte piece index (offset bits 4-6) with the row
// % 8, and an offset's part below bit 4 (the column within a piece, even) never carries into it.
// So from the offset of row r0 (r0 % 8 == 0), row r0 + r8 of the same columns is
// wgmma_row_step(offset, r8); and from the offset of columns 2t, 2t + 1 of tile 0 of a
// [32, 128] tile, channels 8 tile + 2t, + 1 of the same row are wgmma_tile_step(offset, tile).
// (On a byte offset, I = int, as checked below; on an address, I = uintptr_t: wgmma_step_store.)
template <typename I>
__host__ __device__ constexpr I wgmma_row_step(I row0, int r8) {
  return (row0 ^ I(r8 << 4)) + I(r8 * 128);
}
template <typename I>
__host__ __device__ constexpr I wgmma_tile_step(I tile0, int tile) {
  return (tile0 ^ I((tile & 7) << 4)) + I((tile >> 3) * (2 * kChunk * 128));
}
constexpr bool wgmma_steps_exact() {
  for (int half = 0; half < 2; ++half)
    for (int c = 0; c < kHeadDim; c += 2)
      for (int r8 = 0; r8 < 8; ++r8) {
        const int r0 = 8 * half;  // q_decayed: rows 16 + r0 .. of [w; q_decayed]; k_restored: rows r0 ..
        if (wgmma_row_step(kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, kChunk + r0, c), r8) !=
                kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, kChunk + r0 + r8, c) ||
            wgmma_row_step(kWgmmaTilesKr + wgmma_tile_offset(kChunk, r0, c), r8) !=
                kWgmmaTilesKr + wgmma_tile_offset(kChunk, r0 + r8, c))
          return false;
      }
  for (int g = 0; g < 8; ++g)  // w: rows g and g + 8 of [w; q_decayed]
    for (int t = 0; t < 4; ++t)
      for (int tile = 0; tile < kHeadDim / 8; ++tile) {
        const int at = wgmma_tile_step(kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g, 2 * t), tile);
        if (at != kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g, 8 * tile + 2 * t) ||
            at + 8 * 128 != kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g + 8, 8 * tile + 2 * t))
          return false;
      }
  return true;
}
static_assert(wgmma_steps_exact(), "wgmma_row_step and wgmma_tile_step address what wgmma_tile_offset does");
// The same steps on an address, where the block's start is 128-byte aligned (kWorkspaceBytes is a
// multiple of kWorkspaceAlign, and the host checks the workspace's start:
// kda.cuda.forward.workspace_address): the XOR then touches bits 4-6 of the address alone (one
// instruction on its low word), and the added multiples of 128 fold into the store's immediate
// offset. The store is a global one by name: formed from an integer, the address is no longer
// known to be global, and a generic store was compiled (and __stwb's st.global.wb a strong one,
// STG.E.STRONG.SM; nvcc 13.0).
static_assert(kWorkspaceAlign % 128 == 0 && kWorkspaceBytes % kWorkspaceAlign == 0,
              "every workspace block starts 128-byte aligned");
__device__ __forceinline__ uintptr_t address(const unsigned char* at) { return reinterpret_cast<uintptr_t>(at); }
__device__ __forceinline__ void wgmma_step_store(uintptr_t at, uint32_t value) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(at), "r"(value));
}

__device__ __forceinline__ float load_as_float(const void* base, int64_t index, bool is_f32) {
  return is_f32 ? static_cast<const float*>(base)[index]
                : __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// rsqrtf without its subnormal-input path (the argument here is at least 1e-6).
__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The two bf16 halves of a 32-bit word as floats, one instruction each.
__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }

// x rounded to the nearest tf32 value (ties away from zero) once the tensor core drops its
// low 13 mantissa bits: one integer add instead of a truncation bias. For finite x (and
// infinities): a NaN that arithmetic makes (0x7fffffff) carries into the sign bit and becomes -0,
// so a NaN in q or k does not reach M through this product. It still reaches the outputs,
// through q_decayed and through A (split by a mask, which keeps NaNs) and so w and the state.
__device__ __forceinline__ uint32_t round_tf32_finite(float x) { return __float_as_uint(x) + 0x1000u; }
// The same, NaNs and infinities left as they are (a compare and a predicated add): A's left
// operand K~ in the KDA_K1_A_TF32 build, so that a NaN in k, g or beta reaches A's row, then
// inverse_beta's rows from that token on and through U every output of its chunk from there.
// With the bare add there (and w's operands rounded so too) run 213 (H100, 2026-12-07) found
// tokens 9-15 of a chunk finite after a NaN in k. The other operands need no guard: a NaN in q
// reaches o through q_decayed, and w's NaN is inverse_beta's. The guard on every operand cost
// 168 static instructions of kda_prepare_wgmma, on this one 16 (nvcc 13.0, 2026-12-07).
__device__ __forceinline__ uint32_t round_tf32(float x) {
  const uint32_t bits = __float_as_uint(x);
  return fabsf(x) < INFINITY ? bits + 0x1000u : bits;
}

// x_i = b_i - sum_{l < i} A_il x_l for the 16 rows of one right-hand side, in place.
__device__ __forceinline__ void forward_substitute(float (&x)[kChunk], const float (*A)[kRowPad]) {
#pragma unroll
  for (int i = 1; i < kChunk; ++i) {
    float acc = x[i];
#pragma unroll
    for (int l0 = 0; l0 < kChunk; l0 += 4) {
      if (l0 >= i) break;
      const float4 a = *reinterpret_cast<const float4*>(&A[i][l0]);
      const float row[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int l = 0; l < 4; ++l)
        if (l0 + l < i) acc = fmaf(-row[l], x[l0 + l], acc);
    }
    x[i] = acc;
  }
}

// Where warp w keeps column c < 32 of row i of its partial A (columns 0-15) and M (16-31), from
// &qd[0][32 w] (its own columns of qd, which only it has read): the row's eight 4-float groups
// rotated so that both the fragments' 8-byte stores (a half warp: rows g0 .. g0 + 3, two groups
// each) and the sums' 16-byte loads (a quarter warp: rows i, i + 1, four groups each) touch
// every bank once. Row i starts i groups into the banks (kPad = 4 mod 32), so the rotation is
// the spread {0, 4, 2, 6}[i % 4] less i. (ncu, 2026-12-04, run 132: the unrotated rows took
// twice the wavefronts, 6.3 M of K1's 72.5 M on 1x8192 H96.)
// Rows i and i + 8 share a rotation, so a thread computes it once.
__host__ __device__ constexpr int partial_rotation(int i) { return (((0x6240 >> (4 * (i & 3))) & 0xf) - i) & 7; }
__host__ __device__ constexpr int partial_offset(int i, int c, int rotation) {
  return i * kPad + ((((c >> 2) + rotation) & 7) << 2) + (c & 3);
}

// partial_offset's properties, as prepare_body uses it (warp w's block starts at word 32 w).
constexpr bool partial_offset_conflict_free() {
  static_assert(kPad % 32 == 4, "the rotation assumes rows 4 banks apart");
  for (int i = 0; i < kChunk; ++i) {  // rows i and i + 8 share a rotation; a row stays in its 32 columns
    if (partial_rotation(i) != partial_rotation(i % 8)) return false;
    unsigned columns = 0;
    for (int c = 0; c < 32; ++c) columns |= 1u << (partial_offset(i, c, partial_rotation(i)) - i * kPad);
    if (columns != kAllBanks) return false;
  }
  for (int w = 0; w < 4; ++w)
    for (int m = 0; m < 32; m += 16) {  // A's columns, then M's
      for (int g0 = 0; g0 < kChunk; g0 += 4)  // the fragments' stores: a half warp, rows g0 .. g0 + 3, 8 bytes a lane
        for (int half = 0; half < 2; ++half) {
          unsigned banks = 0;
          for (int g = g0; g < g0 + 4; ++g)
            for (int t = 0; t < 4; ++t)
              for (int e = 0; e < 2; ++e)
                banks |= 1u << bank(32 * w + partial_offset(g, m + 8 * half + 2 * t, partial_rotation(g)) + e);
          if (banks != kAllBanks) return false;
        }
      for (int i = 0; i < kChunk; i += 2) {  // the sums' loads: a quarter warp, rows i and i + 1, 16 bytes a lane
        unsigned banks = 0;
        for (int r = i; r < i + 2; ++r)
          for (int j = 0; j < kChunk; j += 4)
            for (int e = 0; e < 4; ++e) banks |= 1u << bank(32 * w + partial_offset(r, m + j, partial_rotation(r)) + e);
        if (banks != kAllBanks) return false;
      }
    }
  return true;
}
static_assert(partial_offset_conflict_free(), "partial_offset: each store and sum of the partials on every bank once");

// A B in 3xTF32 with all three products in one accumulator, small ones first (float32-level
// still; no final sums): for w, which is only rounded to bf16 and has independent tiles to
// overlap its chains with.
__device__ __forceinline__ void mma_3xtf32_single(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  mma_3xtf32(d, d, d, a, b);
}

// Rows g, g + 8 and columns c0 + t, c0 + t + 4 of X: the left operand of an m16n8k8 MMA.
template <int STRIDE>
__device__ __forceinline__ void left_fragment(float (&a)[4], const float (*X)[STRIDE], int c0, int g, int t) {
  a[0] = X[g][c0 + t];
  a[1] = X[g + 8][c0 + t];
  a[2] = X[g][c0 + t + 4];
  a[3] = X[g + 8][c0 + t + 4];
}

// The same four words by one ldmatrix.x4 (kda_prepare_wgmma since 2026-12-05): 32-bit elements
// read as pairs of 16-bit ones, so the [8 rows, 4 columns] blocks (rows g / g + 8, columns c0 /
// c0 + 4) are its four 8x8 matrices, lane l giving row l % 8 of matrix l / 8; lane (g, t) gets
// word t of row g of each. Rows kPad (132 = 4 mod 32) or kRowPad (20) floats apart: the eight rows
// of a matrix on eight different bank groups.
template <int STRIDE>
__device__ __forceinline__ void left_fragment_ldsm(float (&a)[4], const float (*X)[STRIDE], int c0, int lane) {
  static_assert(STRIDE % 4 == 0, "ldmatrix rows are 16-byte aligned");
  uint32_t r[4];
  ldmatrix_x4(r, &X[8 * ((lane / 8) % 2) + lane % 8][c0 + 4 * (lane / 16)]);
  for (int e = 0; e < 4; ++e) a[e] = __uint_as_float(r[e]);
}

// Rows n = 8 half + g, columns c0 + t and c0 + t + 4 of X, for half = 0, 1: the right operands
// (b0, b1) of two m16n8k8 MMAs over X^T's n-tiles, by one ldmatrix.x4 (as left_fragment_ldsm,
// matrix m = 2 half + j holding rows 8 half .., columns c0 + 4 j ..).
template <int STRIDE>
__device__ __forceinline__ void right_fragments_ldsm(float (&b)[2][2], const float (*X)[STRIDE], int c0, int lane) {
  static_assert(STRIDE % 4 == 0, "ldmatrix rows are 16-byte aligned");
  uint32_t r[4];
  ldmatrix_x4(r, &X[8 * (lane / 16) + lane % 8][c0 + 4 * ((lane / 8) % 2)]);
  for (int e = 0; e < 4; ++e) b[e / 2][e % 2] = __uint_as_float(r[e]);
}

// The elementwise stages give each thread two adjacent channels (bf16 pairs load and store as
// one word) and eight rows: channels 32 warp + 2 (lane % 16) + {0, 1}, rows r0 .. r0 + 7 with
// r0 = 8 (lane / 16), so that the two halves of a channel pair are lanes 16 apart.
struct PairRows {
  int c0, r0;
  int raw0, raw_piece;  // raw_index(r0 + r8, c0) = raw0 + 128 r8 + (raw_piece ^ 8 r8), as r0 % 8 = 0
  __device__ explicit PairRows(int tid)
      : c0((tid / 32) * 32 + 2 * (tid % 16)),
        r0(8 * (tid % 32 / 16)),
        raw0(r0 * kHeadDim + c0 % 8),
        raw_piece(((c0 / 8) ^ (r0 / 2)) * 8) {}
  // raw_index(r0 + r8, c0 + e), e < 2 (c0 is even, so c0 + 1 is in c0's piece)
  __device__ int raw(int r8, int e = 0) const { return raw0 + r8 * kHeadDim + (raw_piece ^ (r8 * 8)) + e; }
};

// Tiles tile0 .. tile0 + kTiles - 1 (channels 8 tile ..) of w = inverse_beta K~, in 3xTF32
// (a: inverse_beta as the left operand). An accumulator row holds two adjacent channels,
// stored as one bf16 pair.
template <int kTiles, bool kWgmmaTiles>
__device__ __forceinline__ void w_tiles(const PrepareTiles& s, unsigned char* ws, int tile0, const float (&a)[2][4],
                                        int g, int t) {
  // tile_offset(g, 8 tile + 2 t) = w_row + 16 (tile ^ g); row g + 8 has the same swizzle.
  unsigned char* const w_row = ws + WorkspaceLayout::w + g * kHeadDim * 2 + 2 * t * 2;
  [[maybe_unused]] const int wq_row = kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g, 2 * t);  // tile 0's
#pragma unroll
  for (int tile = tile0; tile < tile0 + kTiles; ++tile) {
    const int n0 = tile * 8;
    float d[4] = {};
    for (int k0 = 0; k0 < kChunk; k0 += 8) {
      const float b[2] = {s.kd[k0 + t][n0 + g], s.kd[k0 + t + 4][n0 + g]};
#if KDA_K1_W_TF32
      // Candidate (off by default; 2026-12-05): one tf32 product, both operands rounded to
      // nearest. w is stored in bf16 (2^-9), the operands' tf32 rounding is 2^-11: on the CUDA
      // path's modelled roundings o and the state moved by under 0.1% against float64
      // (benchmarks/w_rounding.py), and a third of w's MMAs go, with the operands' splits.
      const float(&x)[4] = a[k0 / 8];
      cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(d[0], d[1], d[2], d[3], round_tf32_finite(x[0]),
                                               round_tf32_finite(x[1]), round_tf32_finite(x[2]),
                                               round_tf32_finite(x[3]), round_tf32_finite(b[0]),
                                               round_tf32_finite(b[1]), d[0], d[1], d[2], d[3]);
#else
      mma_3xtf32_single(d, a[k0 / 8], b);
#endif
    }
    if constexpr (kWgmmaTiles) {  // rows 0-15 of [w; q_decayed]
#if KDA_K1_STORE_OFFSETS
      const uintptr_t at = wgmma_tile_step(address(ws + wq_row), tile);
      wgmma_step_store(at, pack_bf16(d[0], d[1]));
      wgmma_step_store(at + 8 * 128, pack_bf16(d[2], d[3]));  // row g + 8
#else
      const int c = n0 + 2 * t;
      *reinterpret_cast<uint32_t*>(ws + kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g, c)) = pack_bf16(d[0], d[1]);
      *reinterpret_cast<uint32_t*>(ws + kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, g + 8, c)) =
          pack_bf16(d[2], d[3]);
#endif
    } else {
      uint32_t* const w_at = reinterpret_cast<uint32_t*>(w_row + ((tile ^ g) << 4));
      w_at[0] = pack_bf16(d[0], d[1]);
      w_at[8 * kHeadDim / 2] = pack_bf16(d[2], d[3]);  // row g + 8
    }
  }
}

// Everything after the gate's activation; kMayBeFar: a row's decay may pass the limit;
// kWgmmaTiles: the three tiles in the wgmma K2's layout (abi.WGMMA_TILES), not ldmatrix's;
// kLdsm: the MMAs' float32 fragments by ldmatrix (left_fragment_ldsm), the same words.
template <bool kMayBeFar, bool kWgmmaTiles, bool kLdsm = false>
__device__ __forceinline__ void prepare_body(const Params& p, PrepareShared<kMayBeFar>& s, const PairRows& pr,
                                             const float (&G)[2][8], const float (&G16)[2], unsigned char* ws) {
  using WS = WorkspaceLayout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __builtin_assume(tid >= 0 && tid < kThreads);
  const int g_row = lane / 4, t_col = lane % 4;  // MMA fragment coordinates

  // Decayed operands: float32 tiles for the MMAs; q_decayed and k_restored to the workspace.
  float rq[8], rk[8];
  for (int r8 = 0; r8 < 8; r8 += 4) {
    *reinterpret_cast<float4*>(&rq[r8]) = *reinterpret_cast<const float4*>(&s.rq[pr.r0 + r8]);
    *reinterpret_cast<float4*>(&rk[r8]) = *reinterpret_cast<const float4*>(&s.rk[pr.r0 + r8]);
  }
  const float gamma[2] = {exp2_approx(G16[0]), exp2_approx(G16[1])};
  unsigned far = 0;
  // tile_offset(r0 + r8, c0) = ws_pair + 256 r8 + 16 ((c0 / 8) ^ r8), as r0 % 8 = 0.
  unsigned char* const ws_pair = ws + pr.r0 * kHeadDim * 2 + pr.c0 % 8 * 2;
  const int piece = pr.c0 / 8;
  // rows r0 of q_decayed and k_restored in the wgmma tiles (wgmma_row_step takes them to r0 + r8)
  [[maybe_unused]] const int qd_row = kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, kChunk + pr.r0, pr.c0);
  [[maybe_unused]] const int kr_row = kWgmmaTilesKr + wgmma_tile_offset(kChunk, pr.r0, pr.c0);
  for (int r8 = 0; r8 < 8; ++r8) {
    const int r = pr.r0 + r8;
    const uint32_t q2 = *reinterpret_cast<const uint32_t*>(&s.q[pr.raw(r8)]);
    const uint32_t k2 = *reinterpret_cast<const uint32_t*>(&s.k[pr.raw(r8)]);
    const float qn[2] = {bf16_lo(q2) * rq[r8], bf16_hi(q2) * rq[r8]};
    const float kn[2] = {bf16_lo(k2) * rk[r8], bf16_hi(k2) * rk[r8]};
    float qd[2], kd[2], ki[2], restored[2];
    for (int e = 0; e < 2; ++e) {
      const float decay = exp2_approx(G[e][r8]);
      qd[e] = qn[e] * decay;
      kd[e] = kn[e] * decay;
      if constexpr (kMayBeFar) {
        ki[e] = kn[e] * exp2_approx(fminf(-G[e][r8], kExp2Limit));
        restored[e] = kn[e] * exp2_approx(G16[e] - G[e][r8]);
        far |= static_cast<unsigned>(G[e][r8] < -kExp2Limit) << r;
      } else {
        // No clamp when no row is far (-G <= 116), so k exp(G_16 - G) = k exp(-G) exp(G_16)
        // up to float rounding, and one exponential per row is saved.
        ki[e] = kn[e] * exp2_approx(-G[e][r8]);
        restored[e] = ki[e] * gamma[e];
      }
    }
    if constexpr (kMayBeFar) *reinterpret_cast<float2*>(&s.g.G[r][pr.c0]) = make_float2(G[0][r8], G[1][r8]);
    *reinterpret_cast<float2*>(&s.qd[r][pr.c0]) = make_float2(qd[0], qd[1]);
    *reinterpret_cast<float2*>(&s.kd[r][pr.c0]) = make_float2(kd[0], kd[1]);
    *reinterpret_cast<float2*>(&s.ki()[r][pr.c0]) = make_float2(ki[0], ki[1]);
    if constexpr (kWgmmaTiles) {  // q_decayed: rows 16-31 of [w; q_decayed]
#if KDA_K1_STORE_OFFSETS
      wgmma_step_store(wgmma_row_step(address(ws + qd_row), r8), pack_bf16(qd[0], qd[1]));
      wgmma_step_store(wgmma_row_step(address(ws + kr_row), r8), pack_bf16(restored[0], restored[1]));
#else
      *reinterpret_cast<uint32_t*>(ws + kWgmmaTilesWq + wgmma_tile_offset(2 * kChunk, kChunk + r, pr.c0)) =
          pack_bf16(qd[0], qd[1]);
      *reinterpret_cast<uint32_t*>(ws + kWgmmaTilesKr + wgmma_tile_offset(kChunk, r, pr.c0)) =
          pack_bf16(restored[0], restored[1]);
#endif
    } else {
      unsigned char* const ws_at = ws_pair + r8 * kHeadDim * 2 + ((piece ^ r8) << 4);
      *reinterpret_cast<uint32_t*>(ws_at + WS::q_decayed) = pack_bf16(qd[0], qd[1]);
      *reinterpret_cast<uint32_t*>(ws_at + WS::k_restored) = pack_bf16(restored[0], restored[1]);
    }
  }
  if (pr.r0 == 0) *reinterpret_cast<float2*>(ws + WS::gamma + pr.c0 * 4) = make_float2(gamma[0], gamma[1]);
  if constexpr (kMayBeFar) {
    far = __reduce_or_sync(0xffffffffu, far);
    if (lane == 0 && far) atomicOr(&s.far_rows, far);
  }
  __syncthreads();

  // 2. A and M, factored form; warp w sums over channels [32 w, 32 w + 32) for both
  // 8-column halves, then stores its partials over the qd columns only it has read.
  {
    const int c0 = warp * 32;
#if KDA_K1_A_TF32
    float a_acc[2][4] = {};
#else
    Tf32x3Accumulators a_acc[2];
#endif
    float m_acc[2][4] = {};
    for (int k0 = c0; k0 < c0 + 32; k0 += 8) {
      float a[4], qd[4], b_halves[2][2];
      if constexpr (kLdsm) {
        left_fragment_ldsm(a, s.kd, k0, lane);
        left_fragment_ldsm(qd, s.qd, k0, lane);
        right_fragments_ldsm(b_halves, s.ki(), k0, lane);
      } else {
        left_fragment(a, s.kd, k0, g_row, t_col);
        left_fragment(qd, s.qd, k0, g_row, t_col);
      }
      const uint32_t qd_tf32[4] = {round_tf32_finite(qd[0]), round_tf32_finite(qd[1]), round_tf32_finite(qd[2]),
                                    round_tf32_finite(qd[3])};
#if KDA_K1_A_TF32
      const uint32_t a_tf32[4] = {round_tf32(a[0]), round_tf32(a[1]), round_tf32(a[2]), round_tf32(a[3])};
#endif
      for (int half = 0; half < 2; ++half) {
        const float b[2] = {kLdsm ? b_halves[half][0] : s.ki()[half * 8 + g_row][k0 + t_col],
                            kLdsm ? b_halves[half][1] : s.ki()[half * 8 + g_row][k0 + t_col + 4]};
#if KDA_K1_A_TF32
        const uint32_t b_tf32[2] = {round_tf32_finite(b[0]), round_tf32_finite(b[1])};
        float(&d)[4] = a_acc[half];
        float(&m)[4] = m_acc[half];
        using Tf32 = cute::SM80_16x8x8_F32TF32TF32F32_TN;
        Tf32::fma(d[0], d[1], d[2], d[3], a_tf32[0], a_tf32[1], a_tf32[2], a_tf32[3], b_tf32[0], b_tf32[1], d[0], d[1],
                  d[2], d[3]);
        Tf32::fma(m[0], m[1], m[2], m[3], qd_tf32[0], qd_tf32[1], qd_tf32[2], qd_tf32[3], b_tf32[0], b_tf32[1], m[0],
                  m[1], m[2], m[3]);
#else
        mma_3xtf32(a_acc[half], a, b);
        float(&m)[4] = m_acc[half];
        cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(m[0], m[1], m[2], m[3], qd_tf32[0], qd_tf32[1], qd_tf32[2],
                                                 qd_tf32[3], round_tf32_finite(b[0]), round_tf32_finite(b[1]), m[0],
                                                 m[1], m[2], m[3]);
#endif
      }
    }
    __syncwarp();  // every lane has read its qd columns
    const int rotation = partial_rotation(g_row);  // (g_row + 8's too)
    for (int half = 0; half < 2; ++half) {
      const int j = half * 8 + 2 * t_col;
      float* part = &s.qd[0][c0];
      const int a_at = partial_offset(g_row, j, rotation), m_at = partial_offset(g_row, 16 + j, rotation);
#if KDA_K1_A_TF32
      *reinterpret_cast<float2*>(part + a_at) = make_float2(a_acc[half][0], a_acc[half][1]);
      *reinterpret_cast<float2*>(part + a_at + 8 * kPad) = make_float2(a_acc[half][2], a_acc[half][3]);
#else
      *reinterpret_cast<float2*>(part + a_at) = make_float2(a_acc[half].sum(0), a_acc[half].sum(1));
      *reinterpret_cast<float2*>(part + a_at + 8 * kPad) = make_float2(a_acc[half].sum(2), a_acc[half].sum(3));
#endif
      *reinterpret_cast<float2*>(part + m_at) = make_float2(m_acc[half][0], m_acc[half][1]);
      *reinterpret_cast<float2*>(part + m_at + 8 * kPad) = make_float2(m_acc[half][2], m_acc[half][3]);
    }
  }
  __syncthreads();
  {  // Sum of the four partials: warps 0, 1 reduce M, warps 2, 3 reduce A, four entries a thread.
    const bool is_A = warp >= 2;
    const int e = (tid % 64) * 4, i = e / kChunk, j = e % kChunk;
    const float* part = &s.qd[0][0] + partial_offset(i, (is_A ? 0 : 16) + j, partial_rotation(i));
    float4 sum = *reinterpret_cast<const float4*>(part);
    for (int w = 1; w < 4; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(part + 32 * w);
      sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
    }
    if (is_A) {
      const float b = s.beta[i];
      *reinterpret_cast<float4*>(&s.A[i][j]) = make_float4(j < i ? sum.x * b : 0.f, j + 1 < i ? sum.y * b : 0.f,
                                                           j + 2 < i ? sum.z * b : 0.f, j + 3 < i ? sum.w * b : 0.f);
    } else {
      *reinterpret_cast<float4*>(&s.M[i][j]) = make_float4(j <= i ? sum.x : 0.f, j + 1 <= i ? sum.y : 0.f,
                                                           j + 2 <= i ? sum.z : 0.f, j + 3 <= i ? sum.w : 0.f);
    }
  }
  __syncthreads();
  if constexpr (kMayBeFar) {
    const unsigned far_rows = s.far_rows;
    if (far_rows) {  // rows past the limit: exp(G_i - G_j) pairwise, exact at any depth
      for (int e = tid; e < kChunk * kChunk; e += kThreads) {
        const int i = e / kChunk, j = e % kChunk;
        if (!((far_rows >> i) & 1) || j > i) continue;
        float a = 0.f, m = 0.f;
        for (int p8 = 0; p8 < kHeadDim / 8; ++p8) {  // d in order, a piece's 8 at a time
          const int at_i = raw_index(i, 8 * p8), at_j = raw_index(j, 8 * p8);
          for (int e8 = 0; e8 < 8; ++e8) {
            const int d = 8 * p8 + e8;
            const float kj =
                __bfloat162float(s.k[at_j + e8]) * s.rk[j] * exp2f(fminf(s.g.G[i][d] - s.g.G[j][d], 0.f));
            a = fmaf(__bfloat162float(s.k[at_i + e8]), kj, a);
            m = fmaf(__bfloat162float(s.q[at_i + e8]), kj, m);
          }
        }
        s.A[i][j] = j < i ? a * s.rk[i] * s.beta[i] : 0.f;
        s.M[i][j] = m * s.rq[i];
      }
      __syncthreads();
    }
  }
  {  // M to bf16, two entries a thread.
    const float2 m = *reinterpret_cast<const float2*>(&s.M[0][0] + 2 * tid);
    reinterpret_cast<uint32_t*>(ws + WS::M)[tid] = pack_bf16(m.x, m.y);
  }

  // 3. inverse_beta column j = (I + A)^-1 beta_j e_j, then over A (which it no longer needs).
  if (tid < kChunk) {
    const int j = tid;
    float ib[kChunk];
    for (int r = 0; r < kChunk; ++r) ib[r] = r == j ? s.beta[j] : 0.f;
    forward_substitute(ib, s.A);
    __syncwarp(0xffffu);  // every column's solve has read A
    for (int r = 0; r < kChunk; ++r) s.A[r][j] = ib[r];
  }
  __syncthreads();
  const float(*inverse_beta)[kRowPad] = s.A;
  {  // As a bf16 pair (hi + lo) for the recurrence, two entries a thread.
    const int i = tid / 8, j = (tid % 8) * 2;
    const float2 x = *reinterpret_cast<const float2*>(&inverse_beta[i][j]);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(x.x, x.y);
    reinterpret_cast<__nv_bfloat162*>(ws + WS::inverse_beta_hi)[tid] = hi;
    reinterpret_cast<uint32_t*>(ws + WS::inverse_beta_lo)[tid] =
        pack_bf16(x.x - __low2float(hi), x.y - __high2float(hi));
  }

  // 4. w = inverse_beta K~ in 8-channel tiles: warp 0, which solved for inverse_beta, takes
  // tile 0 and warps 1-3 five tiles each.
  float a[2][4];
  for (int k0 = 0; k0 < kChunk; k0 += 8) {
    if constexpr (kLdsm)
      left_fragment_ldsm(a[k0 / 8], inverse_beta, k0, lane);
    else
      left_fragment(a[k0 / 8], inverse_beta, k0, g_row, t_col);
  }
#if KDA_K1_STORE_OFFSETS
  switch (warp) {  // each warp's tiles as constants: their kd reads and stores at immediate offsets
    case 0: w_tiles<1, kWgmmaTiles>(s, ws, 0, a, g_row, t_col); break;
    case 1: w_tiles<5, kWgmmaTiles>(s, ws, 1, a, g_row, t_col); break;
    case 2: w_tiles<5, kWgmmaTiles>(s, ws, 6, a, g_row, t_col); break;
    default: w_tiles<5, kWgmmaTiles>(s, ws, 11, a, g_row, t_col); break;
  }
#else
  if (warp == 0)
    w_tiles<1, kWgmmaTiles>(s, ws, 0, a, g_row, t_col);
  else
    w_tiles<5, kWgmmaTiles>(s, ws, 1 + 5 * (warp - 1), a, g_row, t_col);
#endif
}

// Step 1 and the gate for one chunk (bos: its first token; rows of them): the inputs in shared
// memory, beta and the l2norm factors there, and this thread's cumulative log2-decay G (and G16,
// the chunk's total) in registers.
template <bool kMayBeFar>
__device__ __forceinline__ void load_chunk(const Params& p, PrepareShared<kMayBeFar>& s, int64_t bos, int rows,
                                           int64_t h, const PairRows& pr, float (&G)[2][8], float (&G16)[2]) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __builtin_assume(tid >= 0 && tid < kThreads);
  const bool g_f32 = p.flags & kGFloat32;

  // 1. Inputs -> shared memory, 16-byte pieces: thread tid loads piece tid % 16 of rows
  // tid / 16 and tid / 16 + 8 (and of fp32 g, piece tid % 32 of rows tid / 32 + 4 i).
  // 64-bit offsets: T * H * 128 can pass 2^31.
  const int64_t row_stride = p.heads * kHeadDim;  // elements between consecutive tokens
  {
    const int r0 = tid / 16, piece = tid % 16;
    const int64_t src0 = ((bos + r0) * p.heads + h) * kHeadDim + piece * 8;
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i;
      const bool valid = r < rows;
      const int64_t src = valid ? src0 + 8 * i * row_stride : 0;
      const int at = raw_index(r, piece * 8);
      copy_async_16(&s.q[at], p.q + src, valid);
      copy_async_16(&s.k[at], p.k + src, valid);
      if (!g_f32) copy_async_16(&s.g.g16[at], static_cast<const __nv_bfloat16*>(p.g) + src, valid);
    }
  }
  if (g_f32) {
    const int r0 = tid / 32, piece = tid % 32;
    const int64_t src0 = ((bos + r0) * p.heads + h) * kHeadDim + piece * 4;
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 4 * i;
      const bool valid = r < rows;
      const int64_t src = valid ? src0 + 4 * i * row_stride : 0;
      copy_async_16(&s.g.g32[r][piece * 4], static_cast<const float*>(p.g) + src, valid);
    }
  }
  cute::cp_async_fence();
  // The per-row work goes to warp 1 and the norms to warps 2 and 3: warp 0 solves for
  // inverse_beta later (warp i of every CTA shares one scheduler, so the load is spread).
  if (warp == 1 && lane < kChunk) {
    const int r = lane;
    float b = r < rows ? load_as_float(p.beta, (bos + r) * p.heads + h, p.flags & kBetaFloat32) : 0.f;
    if ((p.flags & kBetaSigmoid) && r < rows) b = sigmoid_scaled(static_cast<float>(p.beta_scale), b);
    s.beta[r] = b;
    if (!(p.flags & kL2norm)) {
      s.rq[r] = static_cast<float>(p.scale);
      s.rk[r] = 1.f;
    }
  }
  if (tid == 0) s.far_rows = 0;
  const bool lower_bound = p.flags & kGateLowerBound;
  // The gate lb * sigmoid(a (g + bias)) in base 2 is gate_scale / (1 + 2^(g gate_mul + gate_add)).
  const float gate_a = lower_bound && (p.flags & kHasALog) ? expf(p.A_log[h]) : 1.f;
  const float gate_mul = -gate_a * kLog2e, gate_scale = static_cast<float>(p.lower_bound) * kLog2e;
  float gate_add[2];
  for (int e = 0; e < 2; ++e)
    gate_add[e] = lower_bound && (p.flags & kHasDtBias) ? gate_mul * p.dt_bias[h * kHeadDim + pr.c0 + e] : 0.f;
  cute::cp_async_wait<0>();
  __syncthreads();

  // l2norm: the row norms are the diagonals of Q Q^T and K K^T, one bf16 MMA chain over the
  // 128 channels each (warp 2: q, warp 3: k); products of bf16 are exact in float32.
  if ((p.flags & kL2norm) && warp >= 2) {
    const __nv_bfloat16* X = warp == 2 ? s.q : s.k;
    // ldmatrix lane l addresses row l % 8 of 8 x 8 block l / 8: blocks (rows 0-7, 8-15) x
    // (channels k0 + 0-7, + 8-15), in the left operand's order, and again in the order that
    // makes each 8-row block one right operand (two consecutive registers).
    // raw_index(row, col + k0) = raw_index(row, col) ^ k0 for col < 16 and k0 a multiple of 16
    const int left = raw_index((lane / 8 % 2) * 8 + lane % 8, (lane / 16) * 8);
    const int right = raw_index((lane / 16) * 8 + lane % 8, (lane / 8 % 2) * 8);
    float d[2][4] = {};  // columns: rows 0-7, rows 8-15
    for (int k0 = 0; k0 < kHeadDim; k0 += 16) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, X + (left ^ k0));
      ldmatrix_x4(b, X + (right ^ k0));
      mma_bf16(d[0], a, b[0], b[1]);
      mma_bf16(d[1], a, b[2], b[3]);
    }
    // Entry (g, 2t + e) of the first tile and (g + 8, 8 + 2t + e) of the second: the
    // diagonal where 2t + e = g.
    const int g = lane / 4, t = lane % 4;
    if (t == g / 2) {
      const float scale = warp == 2 ? static_cast<float>(p.scale) : 1.f;
      float* r_out = warp == 2 ? s.rq : s.rk;
      r_out[g] = rsqrt_approx((g % 2 ? d[0][1] : d[0][0]) + kL2normEps) * scale;
      r_out[g + 8] = rsqrt_approx((g % 2 ? d[1][3] : d[1][2]) + kL2normEps) * scale;
    }
  }
  // Gate and cumulative log2-decay of this thread's two channels and eight rows, first from
  // the first of those rows on.
  float acc[2] = {0.f, 0.f};
  if (lower_bound && !g_f32) {  // the common case, apart so that the loop carries no selects
    for (int r8 = 0; r8 < 8; ++r8) {
      const uint32_t gv = *reinterpret_cast<const uint32_t*>(&s.g.g16[pr.raw(r8)]);
      const float x[2] = {fmaf(bf16_lo(gv), gate_mul, gate_add[0]), fmaf(bf16_hi(gv), gate_mul, gate_add[1])};
      for (int e = 0; e < 2; ++e) G[e][r8] = acc[e] = fmaf(gate_scale, rcp_approx(1.f + exp2_approx(x[e])), acc[e]);
    }
  } else {
    for (int r8 = 0; r8 < 8; ++r8) {
      for (int e = 0; e < 2; ++e) {
        const int r = pr.r0 + r8, col = pr.c0 + e;
        const float gv = g_f32 ? s.g.g32[r][col] : __bfloat162float(s.g.g16[pr.raw(r8, e)]);
        if (lower_bound)
          acc[e] = fmaf(gate_scale, rcp_approx(1.f + exp2_approx(fmaf(gv, gate_mul, gate_add[e]))), acc[e]);
        else  // a hard reset (g = -inf, or any g below kHardReset) as the finite kHardReset: the
              // decay through it is 0 in float32 either way, and no -inf - (-inf) is formed; the
              // rows past the exp2 limit that it makes take the pairwise path below. A NaN g stays
              // NaN (fmaxf would make it a silent reset; tests/test_nan.py, 2026-12-07).
          acc[e] = fmaf(gv < kHardReset ? kHardReset : gv, kLog2e, acc[e]);
        G[e][r8] = acc[e];
      }
    }
  }
  if (rows < kChunk) {  // rows past the end add no decay
    for (int e = 0; e < 2; ++e)
      for (int r8 = 0; r8 < 8; ++r8)
        if (pr.r0 + r8 >= rows) G[e][r8] = r8 > 0 ? G[e][r8 - 1] : 0.f;
  }
  // The upper half adds the lower half's total (lane - 16); then G_16 is the upper half's last.
  for (int e = 0; e < 2; ++e) {
    const float below = __shfl_up_sync(0xffffffffu, G[e][7], 16);
    const float base = pr.r0 ? below : 0.f;
    for (int r8 = 0; r8 < 8; ++r8) G[e][r8] += base;
    G16[e] = __shfl_down_sync(0xffffffffu, G[e][7], 16);  // the upper half keeps its own
  }
  __syncthreads();  // every thread has read g (G may replace it) and warps 2, 3 have written the norms

}

// The whole of K1 for one (chunk, head); kMayBeFar: some row's decay may pass the limit
// (abi.prepare_kernel_name, which picks the entry point); kWgmmaTiles, kLdsm: see prepare_body.
template <bool kMayBeFar, bool kWgmmaTiles = false, bool kLdsm = false>
__device__ __forceinline__ void prepare_chunk(const Params& p) {
  __shared__ PrepareShared<kMayBeFar> s;
  const int64_t c = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t n = p.chunk_seq[c];
  const int64_t bos = p.seq_offsets[n] + (c - p.chunk_offsets[n]) * kChunk;
  const int64_t left = p.seq_offsets[n + 1] - bos;  // tokens from this chunk's first on
  // A slot past the call's real chunks (the tables have room for the most the shapes allow):
  // no tokens, and nothing reads its workspace. The whole CTA leaves before any barrier.
  if (left <= 0) return;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kChunk), left));
  unsigned char* ws = p.workspace + (c * p.heads + h) * kWorkspaceBytes;
  const PairRows pr(threadIdx.x);
  float G[2][8], G16[2];
  load_chunk<kMayBeFar>(p, s, bos, rows, h, pr, G, G16);
  prepare_body<kMayBeFar, kWgmmaTiles, kLdsm>(p, s, pr, G, G16, ws);
}

}  // namespace

// The lower-bound gate decays by at most |lb| a token: with lb >= -5.025 no row of 16 tokens
// gets past the limit, and kda_prepare drops the per-row test (the host's choice:
// abi.prepare_kernel_name). Six CTAs an SM there (35.7 KB of shared memory then, 35.2 since
// 2026-12-04; at most 80 registers: 1x8192 H96 K1 0.471 -> 0.446 ms against the same code at
// five, run 73, benchmarks/NOTES.md); kda_prepare_far keeps ki's own tile and five.
extern "C" __global__ void __launch_bounds__(kThreads, 6) kda_prepare(const Params p) { prepare_chunk<false>(p); }
extern "C" __global__ void __launch_bounds__(kThreads, 5) kda_prepare_far(const Params p) { prepare_chunk<true>(p); }
// kda_prepare with its tiles in the wgmma K2's layout (abi.PREPARE_WGMMA_KERNEL): the same
// arithmetic and shared memory, other store addresses (1x8192 H96 0.4468 ms against 0.4461, run
// 120); since 2026-12-05 its float32 fragments read by ldmatrix (prepare_body's kLdsm: the same
// workspace bit for bit, run 140's GPU test; 56 32-bit loads a thread to 14). Only the gates
// kda_prepare serves take the wgmma K2 (kda.cuda.forward.recurrence_kind).
extern "C" __global__ void __launch_bounds__(kThreads, 6) kda_prepare_wgmma(const Params p) {
  prepare_chunk<false, true, true>(p);
}
// kda_prepare_far with its tiles in the wgmma K2's layout (abi.PREPARE_FAR_WGMMA_KERNEL,
// 2026-12-05): the far entry point's arithmetic (the pairwise rows included, which write A and M,
// not the tiles) and the wgmma twin's store addresses and ldmatrix fragments, so that the gates
// it serves (a precomputed g, as Kimi-Linear-48B's serving code passes it; lb < -5.025) can take
// the wgmma K2 too. Taken by default since run 168 (H100, 2026-12-05: the CUDA tests passed, and
// `kda bench` case 7 went from 0.392 to 0.363 ms); KDA_CUDA_FAR_WGMMA=0 keeps kda_prepare_far.
extern "C" __global__ void __launch_bounds__(kThreads, 5) kda_prepare_far_wgmma(const Params p) {
  prepare_chunk<true, true, true>(p);
}

}  // namespace kda

// ---------------------------------------------------------------------------------------------
// The chunk tables (kda.tables) for the CUDA path: the int64 tables of kda/triton/tables.py's
// build_tables_kernel, bit for bit, from cu_seqlens as it is on the device. It lives here, not
// in a fatbin of its own, so that the build, the wheel and the loader keep their three images.
// On the H200 (2026-12-04, benchmarks/host_parts.py) the Triton launch took 59 us of host time
// of a tiny call's 150, a direct cuda-python launch about 6.
//
// Offsets are read clamped into [0, T] and made non-decreasing by a running maximum, so no
// cu_seqlens, whatever a graph replay puts there, sends a kernel outside its tensors. The grid
// comes from the shapes alone (abi.tables_grid), so no CTA can wait for another's results: each
// walks the sequences from the first, kTableTile at a time (block-wide scans of the offsets'
// running maximum and the chunk counts), as far as its role needs:
//   CTA 0: all of them, writing seq_offsets, chunk_offsets and checkpoint_offsets;
//   slot CTAs: up to the sequences owning their kTablesSlots chunk slots, each slot's owner by
//     a binary search over a tile's chunk ends (slots past the real chunks: the last sequence);
//   sequence CTAs: seq_order for kTablesSeqs sequences, each ranked by counting the longer
//     sequences and the equally long earlier ones (a stable sort, longest first) over all the
//     lengths, held in shared memory (up to kOrderMax sequences; past it, in order).
// A walk reads O(N) offsets, as the Triton kernel's programs do: for N in the millions the walks
// of CTA 0 and of the far slot CTAs, not the launch, set the time.
namespace kda {
namespace {

constexpr int kTableItems = 8;  // consecutive sequences per thread in a tile
constexpr int kTableTile = kTablesThreads * kTableItems;
constexpr int kRankLanes = kTablesThreads / kTablesSeqs;  // threads counting for one sequence
static_assert(kRankLanes * kTablesSeqs == kTablesThreads && 32 % kRankLanes == 0, "a sequence's lanes in one warp");

using TableScan = cub::BlockScan<int64_t, kTablesThreads>;

struct TablesShared {
  TableScan::TempStorage scan;
  union {
    int64_t chunk_end[kTableTile];  // slot CTAs: the tile's chunk_offsets[n + 1]
    int64_t length[kOrderMax];  // sequence CTAs: every sequence's length
  };
};

// Where a walk over the sequences stands before its next tile.
struct SequenceWalk {
  int64_t offset = 0;  // the largest offset read so far
  int64_t chunks = 0;  // chunks of the sequences walked
  int64_t checkpoints = 0;  // checkpoint rows of the sequences walked
};

// This thread's kTableItems sequences of a tile: n = first + i.
struct TablesTile {
  int64_t first;
  int64_t start[kTableItems], end[kTableItems];  // token offsets, clamped and non-decreasing
  int64_t chunk_end[kTableItems];  // chunk_offsets[n + 1]
  int64_t checkpoint_end[kTableItems];  // checkpoint_offsets[n + 1] (kCheckpoints only)
};

__device__ __forceinline__ int64_t read_offset(const TablesParams& p, int64_t n) {
  const int64_t x = p.flags & kCuSeqlensInt32 ? int64_t(__ldg(static_cast<const int32_t*>(p.cu_seqlens) + n))
                                              : __ldg(static_cast<const int64_t*>(p.cu_seqlens) + n);
  return min(max(x, int64_t(0)), p.tokens);
}

// The varlen tile of sequences n0 .. n0 + kTableTile (those past N: no chunks), advancing
// walk. Block-wide: every thread calls it, with the same n0.
template <bool kCheckpoints>
__device__ void walk_tile(const TablesParams& p, int64_t n0, SequenceWalk& walk, TablesShared& s, TablesTile& t) {
  const int64_t N = p.num_seqs;
  t.first = n0 + int64_t(threadIdx.x) * kTableItems;
  int64_t x[kTableItems + 1];  // offsets first .. first + kTableItems (the last: the next thread's first)
  int64_t own_max = 0;
  for (int i = 0; i <= kTableItems; ++i) {
    x[i] = t.first + i <= N ? read_offset(p, t.first + i) : 0;
    if (i < kTableItems) own_max = max(own_max, x[i]);
  }
  int64_t before, tile_max;  // the running maximum before this thread's first offset
  TableScan(s.scan).ExclusiveScan(own_max, before, walk.offset, cuda::maximum<>{}, tile_max);
  __syncthreads();
  int64_t chunks[kTableItems], own_chunks = 0, own_checkpoints = 0;
  for (int i = 0; i < kTableItems; ++i) {
    before = max(before, x[i]);
    t.start[i] = before;
    t.end[i] = max(before, x[i + 1]);
    chunks[i] = t.first + i < N ? (t.end[i] - t.start[i] + kChunk - 1) / kChunk : 0;
    own_chunks += chunks[i];
    own_checkpoints += (chunks[i] + kCheckpointChunks - 1) / kCheckpointChunks;
  }
  int64_t chunk_end, tile_chunks;
  TableScan(s.scan).ExclusiveSum(own_chunks, chunk_end, tile_chunks);
  __syncthreads();
  chunk_end += walk.chunks;
  for (int i = 0; i < kTableItems; ++i) t.chunk_end[i] = chunk_end += chunks[i];
  if constexpr (kCheckpoints) {
    int64_t checkpoint_end, tile_checkpoints;
    TableScan(s.scan).ExclusiveSum(own_checkpoints, checkpoint_end, tile_checkpoints);
    __syncthreads();
    checkpoint_end += walk.checkpoints;
    for (int i = 0; i < kTableItems; ++i)
      t.checkpoint_end[i] = checkpoint_end += (chunks[i] + kCheckpointChunks - 1) / kCheckpointChunks;
    walk.checkpoints += tile_checkpoints;
  }
  walk.offset = max(walk.offset, tile_max);
  walk.chunks += tile_chunks;
}

__device__ void write_offsets(const TablesParams& p, TablesShared& s) {
  const int64_t N = p.num_seqs;
  if (!(p.flags & kVarlen)) {  // B sequences of tokens_each tokens
    const int64_t chunks = (p.tokens_each + kChunk - 1) / kChunk;
    const int64_t checkpoints = (chunks + kCheckpointChunks - 1) / kCheckpointChunks;
    for (int64_t n = threadIdx.x; n <= N; n += kTablesThreads) {
      p.seq_offsets[n] = n * p.tokens_each;
      p.chunk_offsets[n] = n * chunks;
      p.checkpoint_offsets[n] = n * checkpoints;
    }
    return;
  }
  if (threadIdx.x == 0) p.chunk_offsets[0] = p.checkpoint_offsets[0] = 0;
  SequenceWalk walk;
  TablesTile t;
  for (int64_t n0 = 0; n0 < N; n0 += kTableTile) {
    walk_tile<true>(p, n0, walk, s, t);
    for (int i = 0; i < kTableItems; ++i) {
      const int64_t n = t.first + i;
      if (n >= N) break;
      p.seq_offsets[n] = t.start[i];
      p.chunk_offsets[n + 1] = t.chunk_end[i];
      p.checkpoint_offsets[n + 1] = t.checkpoint_end[i];
      if (n == N - 1) p.seq_offsets[N] = t.end[i];
    }
  }
}

// chunk_seq[c] for the slots first <= c <= last: the number of sequences whose chunks end at
// or before c (at most N - 1).
__device__ void write_owners(const TablesParams& p, int64_t first, int64_t last, TablesShared& s) {
  const int64_t N = p.num_seqs;
  if (!(p.flags & kVarlen)) {
    const int64_t chunks = max((p.tokens_each + kChunk - 1) / kChunk, int64_t(1));
    for (int64_t c = first + threadIdx.x; c <= last; c += kTablesThreads) p.chunk_seq[c] = min(c / chunks, N - 1);
    return;
  }
  SequenceWalk walk;
  TablesTile t;
  for (int64_t n0 = 0; n0 < N && walk.chunks <= last; n0 += kTableTile) {
    const int64_t tile_first = walk.chunks;
    walk_tile<false>(p, n0, walk, s, t);
    if (walk.chunks <= first) continue;  // the tile's chunks all end before these slots
    for (int i = 0; i < kTableItems; ++i)  // past N: never at or before a slot
      s.chunk_end[threadIdx.x * kTableItems + i] = t.first + i < N ? t.chunk_end[i] : INT64_MAX;
    __syncthreads();
    const int64_t to = min(last, walk.chunks - 1);
    for (int64_t c = max(first, tile_first) + threadIdx.x; c <= to; c += kTablesThreads) {
      int lo = 0, hi = kTableTile;  // the first chunk end past c
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (s.chunk_end[mid] <= c) lo = mid + 1;
        else hi = mid;
      }
      p.chunk_seq[c] = n0 + lo;  // c < the tile's last chunk end: a sequence of this tile
    }
    __syncthreads();
  }
  for (int64_t c = max(first, walk.chunks) + threadIdx.x; c <= last; c += kTablesThreads) p.chunk_seq[c] = N - 1;
}

// seq_order for the sequences m0 .. m0 + kTablesSeqs.
__device__ void write_order(const TablesParams& p, int64_t m0, TablesShared& s) {
  const int64_t N = p.num_seqs, H = p.heads;
  if (!(p.flags & kRankByLength) || N > kOrderMax) {  // in order: seq_order[i] = i
    const int64_t to = min(m0 + kTablesSeqs, N) * H;
    for (int64_t i = m0 * H + threadIdx.x; i < to; i += kTablesThreads) p.seq_order[i] = i;
    return;
  }
  SequenceWalk walk;
  TablesTile t;
  for (int64_t n0 = 0; n0 < N; n0 += kTableTile) {
    walk_tile<false>(p, n0, walk, s, t);
    for (int i = 0; i < kTableItems && t.first + i < N; ++i) s.length[t.first + i] = t.end[i] - t.start[i];
  }
  __syncthreads();
  // kRankLanes adjacent lanes count for sequence m, each over every kRankLanes-th sequence.
  const int64_t m = m0 + threadIdx.x / kRankLanes;
  const int lane = threadIdx.x % kRankLanes;
  int64_t ahead = 0;
  if (m < N) {
    const int64_t length = s.length[m];
    for (int64_t b = lane; b < N; b += kRankLanes) ahead += s.length[b] > length || (s.length[b] == length && b < m);
  }
  for (int width = 1; width < kRankLanes; width *= 2) ahead += __shfl_xor_sync(0xffffffffu, ahead, width);
  if (m < N)
    for (int64_t h = lane; h < H; h += kRankLanes) p.seq_order[ahead * H + h] = m * H + h;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kTablesThreads) kda_build_tables(const TablesParams p) {
  __shared__ TablesShared s;
  const int64_t slot_blocks = (p.num_chunks + kTablesSlots - 1) / kTablesSlots;
  const int64_t block = blockIdx.x;
  if (block == 0) {
    write_offsets(p, s);
  } else if (block <= slot_blocks) {
    const int64_t first = (block - 1) * kTablesSlots;
    write_owners(p, first, min(first + kTablesSlots, p.num_chunks) - 1, s);
  } else {
    write_order(p, (block - 1 - slot_blocks) * kTablesSeqs, s);
  }
}

}  // namespace kda
