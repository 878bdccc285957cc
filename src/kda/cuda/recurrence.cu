// K2, recurrence: sequential over the chunks of a sequence, parallel over (sequence, head)
// pairs and slices of V.
//
// A CTA of WARPS consumer warps (plus a producer warp) owns 16 * WARPS rows of the VK state
// of one (sequence, head); each consumer warp owns 16 rows, S^T [16, 128], in float32
// mma.sync accumulators for the whole sequence (64 registers a thread). Rows of the VK state
// evolve independently, so the V split needs no exchange. Per chunk, transposed as in kda/triton/recurrence.py:
//
//     U^T      = V^T inverse_beta^T - S^T w^T
//     S^T_next = S^T Diag(gamma) + U^T k_restored
//     O^T      = S^T q_decayed^T + U^T M^T
//
// S^T and U^T are always the left operand, and an accumulator tile is already laid out as
// the left operand of the next MMA, so the serial chain S -> U -> S stays in registers.
// The chunk's workspace (14 KB, tiles stored swizzled by K1) and v slice stream into shared
// memory through a 3-stage pipeline of bulk (TMA) copies on transaction-count mbarriers,
// issued by one producer warp: the WARPS consumer warps never wait on one another, only on
// their data (full barriers); the producer waits for a stage to be empty before refilling.
// inverse_beta enters as a bf16 pair (hi + lo) so that U keeps ~16 bits of it.
// CTAs take (sequence, head) pairs longest sequence first (Params::seq_order).
#include "kda_cuda.cuh"

namespace kda {
namespace {

// One pipeline stage: the chunk's workspace block as K1 stored it (tiles already swizzled),
// then the CTA's [16, BV] slice of v, rows padded by 16 bytes so that the eight rows an
// ldmatrix.trans reads fall in distinct bank groups.
template <int WARPS>
struct Stage {
  static constexpr int kBV = 16 * WARPS;
  static constexpr int kVRowBytes = kBV * 2;
  static constexpr int kVRowStride = kVRowBytes + 16;
  static constexpr int kBytes = kWorkspaceBytes + kChunk * kVRowStride;
  static constexpr int kOutBytes = kChunk * 16 * 2;  // per warp: O^T staged as [16 tokens, 16 v] bf16
  static constexpr int kSharedBytes = kStages * kBytes + WARPS * kOutBytes;
};

// The loader launches each width with abi.recurrence_shared_bytes (kda_abi.h: the same numbers).
static_assert(Stage<1>::kSharedBytes == recurrence_shared_bytes(1) && Stage<2>::kSharedBytes == recurrence_shared_bytes(2) &&
                  Stage<4>::kSharedBytes == recurrence_shared_bytes(4),
              "the recurrence's shared memory per width differs from src/kda/abi.py");

// The producer warp fills a stage with bulk (TMA) copies that complete on the stage's
// mbarrier: the workspace block in one copy, the v slice one row per lane, valid rows only
// (never read past the end of v). Rows past the sequence end hold stale bytes, which the
// consumers mask out of their V fragments; the producer writes no shared memory itself.
template <int WARPS>
__device__ __forceinline__ void load_stage(unsigned char* stage, uint64_t& full, const unsigned char* ws,
                                           const Params& p, int64_t t0, int rows, int64_t h, int v0) {
  using S = Stage<WARPS>;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    cute::set_barrier_transaction_bytes(full, kWorkspaceBytes + rows * S::kVRowBytes);
    cute::SM90_BULK_COPY_G2S::copy(ws, &full, stage, kWorkspaceBytes);
  }
  __syncwarp();  // the expected byte count is posted before any row copy can complete
  if (lane < rows)
    cute::SM90_BULK_COPY_G2S::copy(p.v + ((t0 + lane) * p.heads + h) * kHeadDim + v0, &full,
                                   stage + kWorkspaceBytes + lane * S::kVRowStride, S::kVRowBytes);
}

// Fragment coordinates of lane l in an m16n8k16 accumulator tile: element e sits at row
// g + 8 (e / 2), column 2 t + (e % 2).
struct Lane {
  int l, g, t;
  __device__ Lane() : l(threadIdx.x % 32), g((threadIdx.x % 32) / 4), t(threadIdx.x % 4) {}
};

// Where element e of accumulator tile j of this lane's S^T rows sits within one (sequence,
// head) state, [V, K] (VK) or [K, V]: 32-bit offsets from the pair's base, which keeps the
// prologue's and epilogue's address registers few (registers are capped, see below).
struct StateOffsets {
  int v, k_stride, v_stride;
  __device__ StateOffsets(const Params& p, int v_warp, const Lane& lane)
      : v(v_warp + lane.g),
        k_stride((p.flags & kStateVFirst) ? 1 : kHeadDim),
        v_stride((p.flags & kStateVFirst) ? kHeadDim : 1) {}
  __device__ int operator()(const Lane& lane, int j, int e) const {
    return (v + 8 * (e / 2)) * v_stride + (8 * j + 2 * lane.t + e % 2) * k_stride;
  }
};

// What a CTA of either chain (K2, or the backward's reverse chain) works on. One linear grid,
// V slices of a pair adjacent, so that the longest-first order of seq_order holds for the whole
// launch (and N * H may pass the 65535 limit of grid.y).
template <int WARPS>
struct ChainSlice {
  static constexpr int kSlices = kHeadDim / Stage<WARPS>::kBV;
  int64_t nh, n, h, bos, eos, c_first, num_chunks;
  int v0, v_warp;  // first V row of this CTA, of this warp
  __device__ ChainSlice(const Params& p, int warp) {
    nh = p.seq_order[blockIdx.x / kSlices];
    n = nh / p.heads;
    h = nh % p.heads;
    v0 = (blockIdx.x % kSlices) * Stage<WARPS>::kBV;
    v_warp = v0 + warp * 16;
    bos = p.seq_offsets[n];
    eos = p.seq_offsets[n + 1];
    c_first = p.chunk_offsets[n];
    num_chunks = p.chunk_offsets[n + 1] - c_first;
  }
  // Valid tokens of the sequence's chunk c (16 but for its last).
  __device__ int rows(int64_t c) const { return static_cast<int>(min(static_cast<int64_t>(kChunk), eos - bos - c * kChunk)); }
};

// This warp's 16 rows of a transposed state from p.h0 (float32 or bf16, either layout), or zeros.
__device__ __forceinline__ void load_state(float (&St)[16][4], const Params& p, const StateOffsets& state_offset,
                                           const Lane& lane, int64_t state_base) {
  for (int j = 0; j < 16; ++j)
    for (int e = 0; e < 4; ++e) {
      const int64_t at = state_base + state_offset(lane, j, e);
      St[j][e] = !(p.flags & kHasH0)       ? 0.f
                 : (p.flags & kH0Bfloat16) ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.h0)[at])
                                           : static_cast<const float*>(p.h0)[at];
    }
}

// This warp's 16 columns of the stage's row-major [16 tokens, BV] tile (v, or dO for the
// backward) as the left operand [16 columns, 16 tokens] of an MMA (ldmatrix.trans); ``rows``
// tokens are left in the sequence, and those past its end (registers 0, 1 hold tokens 2t,
// 2t + 1; 2, 3 tokens 2t + 8, 2t + 9) are masked to zero: their rows hold stale bytes.
template <int WARPS>
__device__ __forceinline__ void token_tile_operand(uint32_t (&a)[4], const unsigned char* tile, int warp,
                                                   const Lane& lane, int64_t rows) {
  const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;
  ldmatrix_x4_trans(a, tile + (r_lo + 8 * sel_b) * Stage<WARPS>::kVRowStride + (warp * 16 + 8 * sel_a) * 2);
  if (rows < kChunk) {
    for (int r = 0; r < 4; ++r) {
      const int token = 2 * lane.t + 8 * (r / 2);
      a[r] &= (token < rows ? 0x0000ffffu : 0u) | (token + 1 < rows ? 0xffff0000u : 0u);
    }
  }
}

// S^T Diag(gamma): key channel 8j + 2t (+1) of tile j scaled by gamma, the chunk's whole decay.
__device__ __forceinline__ void scale_by_gamma(float (&St)[16][4], const float2* gamma, const Lane& lane) {
  for (int j = 0; j < 16; ++j) {
    const float2 gm = gamma[4 * j + lane.t];
    St[j][0] *= gm.x;
    St[j][1] *= gm.y;
    St[j][2] *= gm.x;
    St[j][3] *= gm.y;
  }
}

// The stage pipeline. full[s]: stage s holds its chunk (the producer's arrival plus the copies'
// bytes); empty[s]: every consumer warp is done reading it. Chunk i uses stage i % kStages in
// round i / kStages; both sides step the stage and the round's parity instead of dividing.
// Up to two consumer warps every lane releases the stage itself; at four, one lane a warp
// after __syncwarp(). Both are sound (the warp barrier orders the other lanes' reads before
// lane 0's release), and they differ in speed and in what racecheck sees (H200, nvcc 13.0,
// 2026-12-02, runs 35-36, benchmarks/NOTES.md): every-lane release is racecheck-clean and took
// the 2-warp K2 from 0.557 to 0.518 ms on 1x8192 H96, but at four warps it spills at the
// 128-register cap and ran 2-8% slower; with one lane releasing, racecheck reports the other
// 31 lanes' reads of a stage as racing with its refill (it does not follow __syncwarp).
template <int WARPS>
struct Pipeline {
  static constexpr bool kLaneRelease = WARPS < 4;
  uint64_t* full;
  uint64_t* empty;
  int stage = 0, round_parity = 0;
  __device__ Pipeline(uint64_t* full_, uint64_t* empty_) : full(full_), empty(empty_) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        cute::initialize_barrier(full[s], 1);
        cute::initialize_barrier(empty[s], kLaneRelease ? WARPS * 32 : WARPS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
  __device__ void next() {
    if (++stage == kStages) stage = 0, round_parity ^= 1;
  }
  // The producer warp: runs up to kStages chunks ahead of the consumers, the sequence's chunks
  // in order or (kReverse) from its last.
  template <bool kReverse>
  __device__ void produce(const Params& p, const ChainSlice<WARPS>& cs, unsigned char* smem) {
    for (int64_t i = 0; i < cs.num_chunks; ++i, next()) {
      // Round r >= 1 refills a stage once the consumers' r-th release of it (parity r - 1) is in.
      if (i >= kStages) mbarrier_wait(empty[stage], round_parity ^ 1);
      const int64_t c = kReverse ? cs.num_chunks - 1 - i : i;
      load_stage<WARPS>(smem + stage * Stage<WARPS>::kBytes, full[stage],
                        p.workspace + ((cs.c_first + c) * p.heads + cs.h) * kWorkspaceBytes, p, cs.bos + c * kChunk,
                        cs.rows(c), cs.h, cs.v0);
    }
  }
  __device__ void wait_full() { mbarrier_wait(full[stage], round_parity); }
  __device__ void release(const Lane& lane) {  // this lane (warp) is done with the stage
    if constexpr (kLaneRelease) {
      mbarrier_arrive(empty[stage]);
    } else {
      __syncwarp();
      if (lane.l == 0) mbarrier_arrive(empty[stage]);
    }
  }
};

template <int WARPS>
__device__ __forceinline__ void recurrence(const Params& p) {
  using WS = WorkspaceLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  const Lane lane;
  const int warp = threadIdx.x / 32;
  const ChainSlice<WARPS> cs(p, warp);
  const int64_t n = cs.n, h = cs.h, bos = cs.bos, eos = cs.eos, c_first = cs.c_first, num_chunks = cs.num_chunks;
  const int v_warp = cs.v_warp;

  float St[16][4];  // S^T rows v_warp..+15; tile j holds key channels 8j..8j+7
  const StateOffsets state_offset(p, v_warp, lane);
  const int64_t state_base = cs.nh * kHeadDim * kHeadDim;
  if (warp < WARPS) load_state(St, p, state_offset, lane, state_base);

  __shared__ uint64_t full[kStages], empty[kStages];
  Pipeline<WARPS> pipe(full, empty);
  if (warp == WARPS) {
    pipe.template produce<false>(p, cs, smem);
    return;
  }
  __nv_bfloat16* out_tile = reinterpret_cast<__nv_bfloat16*>(smem + kStages * Stage<WARPS>::kBytes +
                                                             warp * Stage<WARPS>::kOutBytes);

  // The training forward's checkpoints: the float32 state entering every kCheckpointChunks-th
  // chunk, [rows, H, V, K] (as kda/triton/recurrence.py writes them), this warp's 16 V rows.
  float* checkpoint = nullptr;
  if (p.flags & kStoreCheckpoints)
    checkpoint = p.checkpoints + (p.checkpoint_offsets[n] * p.heads + h) * (kHeadDim * kHeadDim) +
                 (v_warp + lane.g) * kHeadDim + 2 * lane.t;
  for (int64_t i = 0; i < num_chunks; ++i, pipe.next()) {
    if (checkpoint != nullptr && i % kCheckpointChunks == 0) {
      // Elements e = 0, 1 of tile j are key channels 8j + 2t, +1 of row g; e = 2, 3 row g + 8.
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<float2*>(checkpoint + 8 * j) = make_float2(St[j][0], St[j][1]);
        *reinterpret_cast<float2*>(checkpoint + 8 * kHeadDim + 8 * j) = make_float2(St[j][2], St[j][3]);
      }
      checkpoint += p.heads * (kHeadDim * kHeadDim);  // the sequence's next checkpoint row
    }
    pipe.wait_full();

    const unsigned char* st = smem + pipe.stage * Stage<WARPS>::kBytes;
    const unsigned char* tile_qd = st + WS::q_decayed;
    const unsigned char* tile_w = st + WS::w;
    const unsigned char* tile_kr = st + WS::k_restored;
    const uint32_t* ib_hi = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_hi);
    const uint32_t* ib_lo = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_lo);
    const uint32_t* M = reinterpret_cast<const uint32_t*>(st + WS::M);
    const float2* gamma = reinterpret_cast<const float2*>(st + WS::gamma);
    const unsigned char* v_tile = st + kWorkspaceBytes;

    // Lane address pattern of an x4 ldmatrix over a 16 x 16 block: matrices (rows 0-7 |
    // 8-15) x (16-byte column piece 0 | 1), in the order each operand's registers need.
    const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;

    // V^T inverse_beta^T, off the serial chain; V^T comes from the row-major v tile by
    // ldmatrix.trans.
    float VB[2][4] = {};
    uint32_t aV[4];
    token_tile_operand<WARPS>(aV, v_tile, warp, lane, eos - bos - i * kChunk);
    for (int nt = 0; nt < 2; ++nt) {
      const int row = (8 * nt + lane.g) * (kChunk / 2) + lane.t;  // 32-bit words, row-major [16, 16]
      mma_bf16(VB[nt], aV, ib_hi[row], ib_hi[row + 4]);
      mma_bf16(VB[nt], aV, ib_lo[row], ib_lo[row + 4]);
    }

    // S^T w^T (on the serial chain) and S^T q_decayed^T (for O^T) take the same left operand:
    // each 16-column step of S^T is converted once and used at once, so no copy of S^T as
    // bf16 stays live (registers decide how many CTAs an SM holds). S^T w^T runs as two
    // accumulator chains, even and odd steps, half as deep.
    float P[2][2][4] = {};
    float O[2][4] = {};
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t aS[4], bw[4], bq[4];
      accumulators_to_operand(aS, St[2 * kk], St[2 * kk + 1]);
      ldmatrix_x4(bw, tile_w + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
      mma_bf16(P[kk % 2][0], aS, bw[0], bw[1]);
      mma_bf16(P[kk % 2][1], aS, bw[2], bw[3]);
      ldmatrix_x4(bq, tile_qd + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
      mma_bf16(O[0], aS, bq[0], bq[1]);
      mma_bf16(O[1], aS, bq[2], bq[3]);
    }
    // U^T = V^T inverse_beta^T - S^T w^T.
    float U[2][4];
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) U[nt][e] = VB[nt][e] - (P[0][nt][e] + P[1][nt][e]);
    uint32_t aU[4];
    accumulators_to_operand(aU, U[0], U[1]);

    // S^T_next = S^T Diag(gamma) + U^T k_restored (k_restored is row-major: ldmatrix.trans).
    scale_by_gamma(St, gamma, lane);
    for (int jp = 0; jp < 8; ++jp) {
      uint32_t bk[4];
      ldmatrix_x4_trans(bk, tile_kr + tile_offset(r_lo + 8 * sel_a, 8 * (2 * jp + sel_b)));
      mma_bf16(St[2 * jp], aU, bk[0], bk[1]);
      mma_bf16(St[2 * jp + 1], aU, bk[2], bk[3]);
    }

    // O^T += U^T M^T.
    for (int nt = 0; nt < 2; ++nt) {
      const int row = (8 * nt + lane.g) * (kChunk / 2) + lane.t;
      mma_bf16(O[nt], aU, M[row], M[row + 4]);
    }
    pipe.release(lane);
    // O^T through shared memory, so that each token's 16 values leave as one 32-byte row.
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e)
        out_tile[(8 * nt + 2 * lane.t + e % 2) * 16 + lane.g + 8 * (e / 2)] = __float2bfloat16_rn(O[nt][e]);
    __syncwarp();
    const int64_t tok = bos + i * kChunk + lane.l / 2;
    if (tok < eos)
      *reinterpret_cast<uint4*>(p.o + (tok * p.heads + h) * kHeadDim + v_warp + 8 * (lane.l % 2)) =
          reinterpret_cast<const uint4*>(out_tile)[lane.l];
    __syncwarp();
  }

  if (p.flags & kStoreHt)
    for (int j = 0; j < 16; ++j)
      for (int e = 0; e < 4; ++e)
        if (p.flags & kHtBfloat16)
          static_cast<__nv_bfloat16*>(p.ht)[state_base + state_offset(lane, j, e)] = __float2bfloat16_rn(St[j][e]);
        else
          static_cast<float*>(p.ht)[state_base + state_offset(lane, j, e)] = St[j][e];
}

// The training backward's reverse chain of the state gradient (kda/triton/state_grad.py's
// state_grad_chain_kernel, reference.recurrence_step_backward) on K1's workspace: K2's
// pipeline, width and registers with the chunks taken from the last to the first. Per chunk,
// transposed as in K2 (this warp's 16 V rows of dS^T, float32 accumulators):
//
//     dU^T      = dO^T M + dS^T k_restored^T
//     dS^T_prev = dS^T Diag(gamma) + dO^T q_decayed - dU^T w
//
// dS^T (the gradient of the state leaving the chunk) is stored in bf16 before each step, and
// after the first chunk the initial state's gradient in float32. Params fields as read here:
// v = dO [T, H, 128] bf16 (its rows stream in as K2's v rows do); h0 = the final state's
// gradient (has_h0, h0_bfloat16, state_v_first); ht = the initial state's gradient, float32
// (store_ht); checkpoints = dS of every chunk, bf16 [num_chunks, H, 128 (V), 128 (K)], the
// layout the Triton chain writes. M enters in bf16 (the Triton chain's is float32 at tf32).
template <int WARPS>
__device__ __forceinline__ void state_grad_chain(const Params& p) {
  using WS = WorkspaceLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  const Lane lane;
  const int warp = threadIdx.x / 32;
  const ChainSlice<WARPS> cs(p, warp);
  const int64_t h = cs.h, c_first = cs.c_first, num_chunks = cs.num_chunks;
  const int v_warp = cs.v_warp;

  float dSt[16][4];  // dS^T rows v_warp..+15; tile j holds key channels 8j..8j+7
  const StateOffsets state_offset(p, v_warp, lane);
  const int64_t state_base = cs.nh * kHeadDim * kHeadDim;
  if (warp < WARPS) load_state(dSt, p, state_offset, lane, state_base);  // p.h0: the final state's gradient

  __shared__ uint64_t full[kStages], empty[kStages];
  Pipeline<WARPS> pipe(full, empty);
  if (warp == WARPS) {
    pipe.template produce<true>(p, cs, smem);
    return;
  }

  __nv_bfloat16* const dstates = reinterpret_cast<__nv_bfloat16*>(p.checkpoints);
  for (int64_t i = 0; i < num_chunks; ++i, pipe.next()) {
    const int64_t c = num_chunks - 1 - i;
    {  // dS leaving chunk c, [c, h, v, k]: elements e = 0, 1 of tile j are key channels 8j + 2t, +1 of row g; e = 2, 3 row g + 8
      __nv_bfloat16* at = dstates + ((c_first + c) * p.heads + h) * (kHeadDim * kHeadDim) +
                          (v_warp + lane.g) * kHeadDim + 2 * lane.t;
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(at + 8 * j) = pack_bf16(dSt[j][0], dSt[j][1]);
        *reinterpret_cast<uint32_t*>(at + 8 * kHeadDim + 8 * j) = pack_bf16(dSt[j][2], dSt[j][3]);
      }
    }
    pipe.wait_full();

    const unsigned char* st = smem + pipe.stage * Stage<WARPS>::kBytes;
    const unsigned char* tile_qd = st + WS::q_decayed;
    const unsigned char* tile_w = st + WS::w;
    const unsigned char* tile_kr = st + WS::k_restored;
    const float2* gamma = reinterpret_cast<const float2*>(st + WS::gamma);
    const unsigned char* do_tile = st + kWorkspaceBytes;
    const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;

    // dO^T, as K2's V^T.
    uint32_t aO[4];
    token_tile_operand<WARPS>(aO, do_tile, warp, lane, cs.eos - cs.bos - c * kChunk);
    // dO^T M: M row-major [16 j, 16 i] is the right operand as stored (ldmatrix.trans, as K2's
    // k_restored), off the serial chain.
    float D[2][4] = {};
    {
      uint32_t bM[4];
      ldmatrix_x4_trans(bM, st + WS::M + (r_lo + 8 * sel_a) * (kChunk * 2) + 8 * sel_b * 2);
      mma_bf16(D[0], aO, bM[0], bM[1]);
      mma_bf16(D[1], aO, bM[2], bM[3]);
    }
    // dS^T k_restored^T (on the serial chain), as K2's S^T w^T: two accumulator chains.
    float P[2][2][4] = {};
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t aS[4], bk[4];
      accumulators_to_operand(aS, dSt[2 * kk], dSt[2 * kk + 1]);
      ldmatrix_x4(bk, tile_kr + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
      mma_bf16(P[kk % 2][0], aS, bk[0], bk[1]);
      mma_bf16(P[kk % 2][1], aS, bk[2], bk[3]);
    }
    float minus_dU[2][4];  // -dU^T, the left operand of the w product
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) minus_dU[nt][e] = -(D[nt][e] + (P[0][nt][e] + P[1][nt][e]));
    uint32_t aU[4];
    accumulators_to_operand(aU, minus_dU[0], minus_dU[1]);

    // dS^T Diag(gamma) + dO^T q_decayed - dU^T w (q_decayed and w row-major: ldmatrix.trans).
    scale_by_gamma(dSt, gamma, lane);
    for (int jp = 0; jp < 8; ++jp) {
      uint32_t bq[4], bw[4];
      ldmatrix_x4_trans(bq, tile_qd + tile_offset(r_lo + 8 * sel_a, 8 * (2 * jp + sel_b)));
      mma_bf16(dSt[2 * jp], aO, bq[0], bq[1]);
      mma_bf16(dSt[2 * jp + 1], aO, bq[2], bq[3]);
      ldmatrix_x4_trans(bw, tile_w + tile_offset(r_lo + 8 * sel_a, 8 * (2 * jp + sel_b)));
      mma_bf16(dSt[2 * jp], aU, bw[0], bw[1]);
      mma_bf16(dSt[2 * jp + 1], aU, bw[2], bw[3]);
    }
    pipe.release(lane);
  }

  if (p.flags & kStoreHt)
    for (int j = 0; j < 16; ++j)
      for (int e = 0; e < 4; ++e) static_cast<float*>(p.ht)[state_base + state_offset(lane, j, e)] = dSt[j][e];
}

}  // namespace

// One entry point per width, each with one more warp, the producer. Registers are
// allocated per SM sub-partition (16384 each), so the cap decides how many CTAs an SM holds:
// at 168, three warps a sub-partition (two-warp CTAs: four an SM, eight consumer warps); at
// 128, four (four-warp CTAs: three an SM, twelve consumer warps). The loop needs no more
// than 128 without spilling; forward.recurrence_warps picks the width (2026-11-30, commit 0f49568, run 3).
extern "C" __global__ void __maxnreg__(168) kda_recurrence_w1(const Params p) { recurrence<1>(p); }
extern "C" __global__ void __maxnreg__(168) kda_recurrence_w2(const Params p) { recurrence<2>(p); }
extern "C" __global__ void __maxnreg__(128) kda_recurrence_w4(const Params p) { recurrence<4>(p); }
// The training backward's reverse chain at K2's two narrow widths (abi.CHAIN_WIDTHS): at four
// warps and 128 registers it spilled 52 B (ptxas, nvcc 13.0, 2026-12-02).
extern "C" __global__ void __maxnreg__(168) kda_state_grad_chain_w1(const Params p) { state_grad_chain<1>(p); }
extern "C" __global__ void __maxnreg__(168) kda_state_grad_chain_w2(const Params p) { state_grad_chain<2>(p); }

}  // namespace kda
