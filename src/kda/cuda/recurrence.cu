// K2, recurrence: sequential over the chunks of a sequence, parallel over (sequence, head)
// pairs and slices of V.
//
// A CTA of WARPS warps owns 16 * WARPS rows of the VK state of one (sequence, head); each
// warp owns 16 rows, S^T [16, 128], in float32 mma.sync accumulators for the whole sequence
// (64 registers a thread). Rows of the VK state evolve independently, so the V split needs
// no exchange. Per chunk, transposed as in kda/triton/recurrence.py:
//
//     U^T      = V^T inverse_beta^T - S^T w^T
//     S^T_next = S^T Diag(gamma) + U^T k_restored
//     O^T      = S^T q_decayed^T + U^T M^T
//
// S^T and U^T are always the left operand, and an accumulator tile is already laid out as
// the left operand of the next MMA, so the serial chain S -> U -> S stays in registers.
// The chunk's workspace (14 KB) and v tile stream into shared memory through a 3-stage
// cp.async pipeline, tiles swizzled so that ldmatrix reads are conflict-free.
// inverse_beta enters as a bf16 pair (hi + lo) so that U keeps ~16 bits of it.
// CTAs take (sequence, head) pairs longest sequence first (Params::seq_order).
#include "kda_cuda.cuh"

namespace kda {
namespace {

constexpr int kStages = 3;
constexpr uint32_t kNegateBf16x2 = 0x80008000u;

template <int WARPS>
struct Stage {
  static constexpr int kBV = 16 * WARPS;
  static constexpr int kVTileBytes = kChunk * kBV * 2;
  static constexpr int kBytes = kWorkspaceBytes + kVTileBytes;
};

// Byte offset of 16-byte piece `chunk16` of row `row` in a swizzled [16, 128] bf16 tile.
__device__ __forceinline__ int swizzled(int row, int chunk16) { return row * 256 + ((chunk16 ^ (row & 7)) << 4); }

template <int WARPS>
__device__ __forceinline__ void load_stage(unsigned char* stage, const unsigned char* ws, const Params& p,
                                           int64_t t0, int64_t eos, int64_t h, int v0) {
  using WS = WorkspaceLayout;
  constexpr int kTilePieces = WS::kTileBytes / 16;
  constexpr int kSwizzledPieces = 3 * kTilePieces;  // q_decayed, w, k_restored
  for (int piece = threadIdx.x; piece < kWorkspaceBytes / 16; piece += 32 * WARPS) {
    int dst = piece * 16;
    if (piece < kSwizzledPieces) {
      const int tile = piece / kTilePieces, in_tile = piece % kTilePieces;
      dst = tile * WS::kTileBytes + swizzled(in_tile / 16, in_tile % 16);
    }
    copy_async_16(stage + dst, ws + piece * 16, true);
  }
  constexpr int kRowPieces = Stage<WARPS>::kBV / 8;
  unsigned char* v_tile = stage + kWorkspaceBytes;
  for (int piece = threadIdx.x; piece < kChunk * kRowPieces; piece += 32 * WARPS) {
    const int row = piece / kRowPieces, col = (piece % kRowPieces) * 8;
    const int64_t tok = t0 + row;
    const bool valid = tok < eos;  // rows past the end are zero-filled
    const __nv_bfloat16* src = p.v + (valid ? (tok * p.heads + h) * kHeadDim + v0 + col : 0);
    copy_async_16(v_tile + (row * Stage<WARPS>::kBV + col) * 2, src, valid);
  }
}

// Fragment coordinates of lane l in an m16n8k16 accumulator tile: element e sits at row
// g + 8 (e / 2), column 2 t + (e % 2).
struct Lane {
  int l, g, t;
  __device__ Lane() : l(threadIdx.x % 32), g((threadIdx.x % 32) / 4), t(threadIdx.x % 4) {}
};

__device__ __forceinline__ int64_t state_index(const Params& p, int64_t nh, int v, int k) {
  return (p.flags & kStateVFirst) ? (nh * kHeadDim + v) * kHeadDim + k : (nh * kHeadDim + k) * kHeadDim + v;
}

template <int WARPS>
__device__ __forceinline__ void recurrence(const Params& p) {
  using WS = WorkspaceLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  const Lane lane;
  const int warp = threadIdx.x / 32;
  // One linear grid, V slices of a pair adjacent, so that the longest-first order of
  // seq_order holds for the whole launch (and N * H may pass the 65535 limit of grid.y).
  constexpr int kSlices = kHeadDim / Stage<WARPS>::kBV;
  const int64_t nh = p.seq_order[blockIdx.x / kSlices];
  const int64_t n = nh / p.heads, h = nh % p.heads;
  const int v0 = (blockIdx.x % kSlices) * Stage<WARPS>::kBV;  // first V row of this CTA
  const int v_warp = v0 + warp * 16;              // first V row of this warp
  const int64_t bos = p.seq_offsets[n], eos = p.seq_offsets[n + 1];
  const int64_t c_first = p.chunk_offsets[n], num_chunks = p.chunk_offsets[n + 1] - c_first;

  float St[16][4];  // S^T rows v_warp..+15; tile j holds key channels 8j..8j+7
  for (int j = 0; j < 16; ++j)
    for (int e = 0; e < 4; ++e)
      St[j][e] = (p.flags & kHasH0)
                     ? p.h0[state_index(p, nh, v_warp + lane.g + 8 * (e / 2), 8 * j + 2 * lane.t + e % 2)]
                     : 0.f;

  auto ws_of = [&](int64_t i) { return p.workspace + ((c_first + i) * p.heads + h) * kWorkspaceBytes; };
  auto stage_of = [&](int64_t i) { return smem + (i % kStages) * Stage<WARPS>::kBytes; };
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < num_chunks) load_stage<WARPS>(stage_of(i), ws_of(i), p, bos + i * kChunk, eos, h, v0);
    cute::cp_async_fence();
  }

  for (int64_t i = 0; i < num_chunks; ++i) {
    cute::cp_async_wait<kStages - 2>();
    __syncthreads();
    const int64_t ahead = i + kStages - 1;
    if (ahead < num_chunks) load_stage<WARPS>(stage_of(ahead), ws_of(ahead), p, bos + ahead * kChunk, eos, h, v0);
    cute::cp_async_fence();

    const unsigned char* st = stage_of(i);
    const unsigned char* tile_qd = st + WS::q_decayed;
    const unsigned char* tile_w = st + WS::w;
    const unsigned char* tile_kr = st + WS::k_restored;
    const uint32_t* ib_hi = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_hi);
    const uint32_t* ib_lo = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_lo);
    const uint32_t* M = reinterpret_cast<const uint32_t*>(st + WS::M);
    const float2* gamma = reinterpret_cast<const float2*>(st + WS::gamma);
    const unsigned char* v_tile = st + kWorkspaceBytes;

    // S^T as the left operand, one 16-column step per k-step.
    uint32_t aS[8][4];
    for (int kk = 0; kk < 8; ++kk) accumulators_to_operand(aS[kk], St[2 * kk], St[2 * kk + 1]);

    // Lane address pattern of an x4 ldmatrix over a 16 x 16 block: matrices (rows 0-7 |
    // 8-15) x (16-byte column piece 0 | 1), in the order each operand's registers need.
    const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;

    // U^T = V^T inverse_beta^T - S^T w^T; V^T comes from the row-major v tile by ldmatrix.trans.
    float U[2][4] = {};
    uint32_t aV[4];
    ldmatrix_x4_trans(aV, v_tile + ((r_lo + 8 * sel_b) * Stage<WARPS>::kBV + warp * 16 + 8 * sel_a) * 2);
    for (int nt = 0; nt < 2; ++nt) {
      const int row = (8 * nt + lane.g) * (kChunk / 2) + lane.t;  // 32-bit words, row-major [16, 16]
      mma_bf16(U[nt], aV, ib_hi[row], ib_hi[row + 4]);
      mma_bf16(U[nt], aV, ib_lo[row], ib_lo[row + 4]);
    }
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t bw[4];
      const int row = r_lo + 8 * sel_b;
      ldmatrix_x4(bw, tile_w + swizzled(row, 2 * kk + sel_a));
      const uint32_t neg[4] = {aS[kk][0] ^ kNegateBf16x2, aS[kk][1] ^ kNegateBf16x2, aS[kk][2] ^ kNegateBf16x2,
                               aS[kk][3] ^ kNegateBf16x2};
      mma_bf16(U[0], neg, bw[0], bw[1]);
      mma_bf16(U[1], neg, bw[2], bw[3]);
    }
    uint32_t aU[4];
    accumulators_to_operand(aU, U[0], U[1]);

    // S^T_next = S^T Diag(gamma) + U^T k_restored (k_restored is row-major: ldmatrix.trans).
    for (int j = 0; j < 16; ++j) {
      const float2 gm = gamma[4 * j + lane.t];
      St[j][0] *= gm.x;
      St[j][1] *= gm.y;
      St[j][2] *= gm.x;
      St[j][3] *= gm.y;
    }
    for (int jp = 0; jp < 8; ++jp) {
      uint32_t bk[4];
      ldmatrix_x4_trans(bk, tile_kr + swizzled(r_lo + 8 * sel_a, 2 * jp + sel_b));
      mma_bf16(St[2 * jp], aU, bk[0], bk[1]);
      mma_bf16(St[2 * jp + 1], aU, bk[2], bk[3]);
    }

    // O^T = S^T q_decayed^T + U^T M^T, off the serial chain.
    float O[2][4] = {};
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t bq[4];
      ldmatrix_x4(bq, tile_qd + swizzled(r_lo + 8 * sel_b, 2 * kk + sel_a));
      mma_bf16(O[0], aS[kk], bq[0], bq[1]);
      mma_bf16(O[1], aS[kk], bq[2], bq[3]);
    }
    for (int nt = 0; nt < 2; ++nt) {
      const int row = (8 * nt + lane.g) * (kChunk / 2) + lane.t;
      mma_bf16(O[nt], aU, M[row], M[row + 4]);
    }
    const int64_t t0 = bos + i * kChunk;
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int64_t tok = t0 + 8 * nt + 2 * lane.t + e % 2;
        if (tok < eos) p.o[(tok * p.heads + h) * kHeadDim + v_warp + lane.g + 8 * (e / 2)] = __float2bfloat16_rn(O[nt][e]);
      }
  }

  if (p.flags & kStoreHt)
    for (int j = 0; j < 16; ++j)
      for (int e = 0; e < 4; ++e)
        p.ht[state_index(p, nh, v_warp + lane.g + 8 * (e / 2), 8 * j + 2 * lane.t + e % 2)] = St[j][e];
}

}  // namespace

// One entry point per CTA width; the loader picks by parallelism (kda/cuda/loader.py).
extern "C" __global__ void __launch_bounds__(32) kda_recurrence_w1(const Params p) { recurrence<1>(p); }
extern "C" __global__ void __launch_bounds__(64) kda_recurrence_w2(const Params p) { recurrence<2>(p); }
extern "C" __global__ void __launch_bounds__(128) kda_recurrence_w4(const Params p) { recurrence<4>(p); }

}  // namespace kda
