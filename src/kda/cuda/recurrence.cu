// K2, recurrence: sequential over the chunks of a sequence, parallel over (sequence, head)
// pairs and slices of V.
//
// A CTA of WARPS 16-row groups (plus a producer warp) owns 16 * WARPS rows of the VK state
// of one (sequence, head); a consumer warp owns a group's 16 rows, S^T [16, 128], in float32
// mma.sync accumulators for the whole sequence (64 registers a thread), or, where the group's
// K is split between two warps (recurrence<WARPS, 2>), half of its columns (32 registers).
// Rows of the VK state evolve independently, so the V split needs no exchange. Per chunk, transposed as in kda/triton/recurrence.py:
//
//     U^T      = V^T inverse_beta^T - S^T w^T
//     S^T_next = S^T Diag(gamma) + U^T k_restored
//     O^T      = S^T q_decayed^T + U^T M^T
//
// S^T and U^T are always the left operand, and an accumulator tile is already laid out as
// the left operand of the next MMA, so the serial chain S -> U -> S stays in registers.
// The chunk's workspace (14 KB, tiles stored swizzled by K1, one bulk (TMA) copy) and v slice
// (cp.async pieces) stream into shared memory through a 3-stage pipeline on transaction-count
// mbarriers, filled by one producer warp: unsplit consumer warps never wait on one another,
// only on their data (full barriers), and the two warps of a split group meet once a chunk;
// the producer waits for a stage to be empty before refilling.
// inverse_beta enters as a bf16 pair (hi + lo) so that U keeps ~16 bits of it.
// CTAs take (sequence, head) pairs longest sequence first (Params::seq_order).
#include "kda_cuda.cuh"

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

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
};

// The producer warp fills a stage: the workspace block in one bulk (TMA) copy, whose bytes the
// stage's full barrier counts, and the v slice as 16-byte cp.async pieces spread over the 32
// lanes, each lane's arrival (noinc) landing once its pieces have. Valid rows only (never read
// past the end of v); rows past the sequence end hold stale bytes, which the consumers mask out
// of their V fragments. One bulk copy a v row, as before 2026-12-04, kept the producer busy for
// the whole chunk step: a bulk copy takes its operands from uniform registers, so the 16 row
// copies issued one lane after another (ncu, 1x32768 H32: the producer warp stalled as long as
// a consumer warp, and the consumers spent 20% of their step waiting on the full barrier).
template <int WARPS>
__device__ __forceinline__ void load_stage(unsigned char* stage, uint64_t& full, const unsigned char* ws,
                                           const Params& p, int64_t t0, int rows, int64_t h, int v0) {
  using S = Stage<WARPS>;
  constexpr int kPieces = S::kVRowBytes / 16;  // 16-byte pieces of a row of the slice
  const int lane = threadIdx.x % 32;
  if (p.flags & kVZero) rows = 0;  // v is taken as zeros: nothing of it to load
  for (int i = lane; i < kChunk * kPieces; i += 32) {
    const int row = i / kPieces, piece = i % kPieces;
    if (row < rows)
      copy_async_16(stage + kWorkspaceBytes + row * S::kVRowStride + piece * 16,
                    p.v + ((t0 + row) * p.heads + h) * kHeadDim + v0 + piece * 8, true);
  }
  cp_async_arrive_noinc(full);
  if (lane == 0) {
    cute::set_barrier_transaction_bytes(full, kWorkspaceBytes);
    cute::SM90_BULK_COPY_G2S::copy(ws, &full, stage, kWorkspaceBytes);
  }
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
  // cta: the CTA's index in the launch of one run (blockIdx.x but in recurrence_wgmma_runs)
  __device__ ChainSlice(const Params& p, int warp, int64_t cta = blockIdx.x) {
    nh = p.seq_order[cta / kSlices];
    n = nh / p.heads;
    h = nh % p.heads;
    v0 = static_cast<int>(cta % kSlices) * Stage<WARPS>::kBV;
    v_warp = v0 + warp * 16;
    bos = p.seq_offsets[n];
    eos = p.seq_offsets[n + 1];
    c_first = p.chunk_offsets[n];
    num_chunks = p.chunk_offsets[n + 1] - c_first;
  }
  // Valid tokens of the sequence's chunk c (16 but for its last).
  __device__ int rows(int64_t c) const { return static_cast<int>(min(static_cast<int64_t>(kChunk), eos - bos - c * kChunk)); }
};

// This warp's 16 rows of a transposed state from p.h0 (float32 or bf16, either layout), or zeros:
// its TILES accumulator tiles, tile jl holding key channels 8 j .. 8 j + 7 with j = tile_of(jl).
struct SameTile {
  __device__ int operator()(int jl) const { return jl; }
};

template <int TILES = 16, class TileOf = SameTile>
__device__ __forceinline__ void load_state(float (&St)[TILES][4], const Params& p, const StateOffsets& state_offset,
                                           const Lane& lane, int64_t state_base, TileOf tile_of = TileOf()) {
  for (int jl = 0; jl < TILES; ++jl)
    for (int e = 0; e < 4; ++e) {
      const int64_t at = state_base + state_offset(lane, tile_of(jl), e);
      St[jl][e] = !(p.flags & kHasH0)       ? 0.f
                  : (p.flags & kH0Bfloat16) ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.h0)[at])
                                            : static_cast<const float*>(p.h0)[at];
    }
}

// The final state from S^T, where the call stores it (load_state's counterpart).
template <int TILES = 16, class TileOf = SameTile>
__device__ __forceinline__ void store_state(const float (&St)[TILES][4], const Params& p,
                                            const StateOffsets& state_offset, const Lane& lane, int64_t state_base,
                                            TileOf tile_of = TileOf()) {
  if (!(p.flags & kStoreHt)) return;
  for (int jl = 0; jl < TILES; ++jl)
    for (int e = 0; e < 4; ++e) {
      const int64_t at = state_base + state_offset(lane, tile_of(jl), e);
      if (p.flags & kHtBfloat16)
        static_cast<__nv_bfloat16*>(p.ht)[at] = __float2bfloat16_rn(St[jl][e]);
      else
        static_cast<float*>(p.ht)[at] = St[jl][e];
    }
}

// The two warps of a split V group (recurrence<WARPS, 2>) meet at named barrier 1 + group
// (barrier 0 is __syncthreads').
// (Immediate ids: with the id in a register ptxas reserves all sixteen of the CTA's barriers,
// which counts against how many CTAs an SM holds; a helper's review, 2026-12-04.)
__device__ __forceinline__ void pair_barrier(int group) {
  if (group == 0)
    asm volatile("bar.sync 1, 64;" ::: "memory");
  else
    asm volatile("bar.sync 2, 64;" ::: "memory");
}

// Columns column..column+15 of a staged row-major [16 tokens, BV] tile (v, or dO for the
// backward) as the left operand [16 columns, 16 tokens] of an MMA (ldmatrix.trans); ``rows``
// tokens are left in the sequence, and those past its end (registers 0, 1 hold tokens 2t,
// 2t + 1; 2, 3 tokens 2t + 8, 2t + 9) are masked to zero: their rows hold stale bytes.
__device__ __forceinline__ void token_tile_operand(uint32_t (&a)[4], const unsigned char* tile, int row_stride,
                                                   int column, const Lane& lane, int64_t rows) {
  const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;
  ldmatrix_x4_trans(a, tile + (r_lo + 8 * sel_b) * row_stride + (column + 8 * sel_a) * 2);
  if (rows < kChunk) {
    for (int r = 0; r < 4; ++r) {
      const int token = 2 * lane.t + 8 * (r / 2);
      a[r] &= (token < rows ? 0x0000ffffu : 0u) | (token + 1 < rows ? 0xffff0000u : 0u);
    }
  }
}

// S^T Diag(gamma): key channel 8j + 2t (+1) of tile j scaled by gamma, the chunk's whole decay;
// the warp's TILES tiles, tile jl being tile j = tile_of(jl) (as load_state).
template <int TILES = 16, class TileOf = SameTile>
__device__ __forceinline__ void scale_by_gamma(float (&St)[TILES][4], const float2* gamma, const Lane& lane,
                                               TileOf tile_of = TileOf()) {
  for (int jl = 0; jl < TILES; ++jl) {
    const float2 gm = gamma[4 * tile_of(jl) + lane.t];
    St[jl][0] *= gm.x;
    St[jl][1] *= gm.y;
    St[jl][2] *= gm.x;
    St[jl][3] *= gm.y;
  }
}

// The stage pipeline. full[s]: stage s holds its chunk (the producer's arrival plus the copies'
// bytes); empty[s]: every consumer warp is done reading it. Chunk i uses stage i % STAGES in
// round i / STAGES; both sides step the stage and the round's parity instead of dividing.
// Up to two 16-row groups every lane releases the stage itself (LANE_RELEASE, also the state
// products' and the split groups' choice); at four unsplit groups, one lane a warp after
// __syncwarp(). Both are sound (the warp
// barrier orders the other lanes' reads before lane 0's release), and they differ in speed and
// in what racecheck sees (H200, nvcc 13.0, 2026-12-02, runs 35-36, benchmarks/NOTES.md):
// every-lane release is racecheck-clean and took the 2-warp K2 from 0.557 to 0.518 ms on 1x8192
// H96, but at four warps it spills at the 128-register cap and ran 2-8% slower; with one lane
// releasing, racecheck reports the other 31 lanes' reads of a stage as racing with its refill
// (it does not follow __syncwarp).
// FULL_ARRIVALS: arrivals a stage's fill makes (load_stage: the producer's 32 lanes' cp.async
// arrivals and lane 0's expect-tx arrival). CONSUMERS: the warps that read a stage (WARPS, the
// stage's 16-row V groups, or twice that where each group's K is split between two warps).
template <int WARPS, int STAGES = kStages, bool LANE_RELEASE = (WARPS < 4), int FULL_ARRIVALS = 33,
          int CONSUMERS = WARPS>
struct Pipeline {
  static constexpr bool kLaneRelease = LANE_RELEASE;
  uint64_t* full;
  uint64_t* empty;
  int stage = 0, round_parity = 0;
  __device__ Pipeline(uint64_t* full_, uint64_t* empty_) : full(full_), empty(empty_) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; ++s) {
        cute::initialize_barrier(full[s], FULL_ARRIVALS);
        cute::initialize_barrier(empty[s], kLaneRelease ? CONSUMERS * 32 : CONSUMERS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
  __device__ void next() {
    if (++stage == STAGES) stage = 0, round_parity ^= 1;
  }
  // The producer warp: runs up to STAGES chunks ahead of the consumers, the sequence's chunks
  // in order or (kReverse) from its last.
  template <bool kReverse>
  __device__ void produce(const Params& p, const ChainSlice<WARPS>& cs, unsigned char* smem) {
    for (int64_t i = 0; i < cs.num_chunks; ++i, next()) {
      // Round r >= 1 refills a stage once the consumers' r-th release of it (parity r - 1) is in.
      if (i >= STAGES) mbarrier_wait(empty[stage], round_parity ^ 1);
      const int64_t c = kReverse ? cs.num_chunks - 1 - i : i;
      load_stage<WARPS>(smem + stage * Stage<WARPS>::kBytes, full[stage],
                        p.workspace + ((cs.c_first + c) * p.heads + cs.h) * kWorkspaceBytes, p, cs.bos + c * kChunk,
                        cs.rows(c), cs.h, cs.v0);
    }
    cute::cp_async_wait<0>();  // no thread leaves with its copies in flight
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

// K2's consumer loop. WARPS 16-row V groups a CTA; KSPLIT = 2 splits each group's K between two
// warps (2026-12-04), for calls with too few (sequence, head) pairs to give every SM sub-partition
// a warp: each warp of a pair holds half of the group's S^T (the tiles of the 16-column steps kk
// of its parity), so the serial chain's MMAs per warp halve. The two exchange, once a chunk,
// their halves of S^T w^T (the even and odd accumulator chains of the unsplit loop, so U, and
// with it S and the final state, are bit for bit the unsplit kernel's) and of S^T q_decayed^T,
// through shared memory at a named barrier of the pair; warp kh then finishes the output of
// tokens 8 kh .. 8 kh + 7. The output's float32 sum is ordered differently from the unsplit
// kernel's (the even steps' sum plus the odd steps', then U^T M^T): the same accuracy, other bits.
template <int WARPS, int KSPLIT>
struct Consumers {
  static_assert(KSPLIT == 1 || (KSPLIT == 2 && WARPS <= 2), "pair_barrier names barriers 1 and 2: two split groups");
  static constexpr int kWarps = WARPS * KSPLIT;
  static constexpr int kTiles = 16 / KSPLIT;  // S^T accumulator tiles a warp holds
  // The pair's exchange, per V group, step parity (two buffers: a warp writes step i + 1's while
  // its partner may still read step i's) and warp of the pair: 12 floats a lane, S^T w^T's two
  // n-tiles and the partner's n-tile of S^T q_decayed^T, as three float4 [3][32].
  static constexpr int kExchangeFloat4s = KSPLIT == 1 ? 0 : 2 * KSPLIT * 3 * 32;  // per V group
  static constexpr int shared_bytes() {
    return kStages * Stage<WARPS>::kBytes + kWarps * Stage<WARPS>::kOutBytes + WARPS * kExchangeFloat4s * 16;
  }
  // Tile jl of this warp's S^T is tile j of the group's: key channels 8j..8j+7.
  __device__ static int tile(int jl, int kh) { return KSPLIT == 1 ? jl : 4 * (jl / 2) + 2 * kh + jl % 2; }
};

// The loader launches each entry point with abi.recurrence_shared_bytes (kda_abi.h: the same numbers).
static_assert(Consumers<1, 1>::shared_bytes() == recurrence_shared_bytes(1) &&
                  Consumers<2, 1>::shared_bytes() == recurrence_shared_bytes(2) &&
                  Consumers<4, 1>::shared_bytes() == recurrence_shared_bytes(4) &&
                  Consumers<2, 2>::shared_bytes() == recurrence_shared_bytes(2, 2),
              "the recurrence's shared memory per width differs from src/kda/abi.py");

template <int WARPS, int KSPLIT = 1>
__device__ __forceinline__ void recurrence(const Params& p) {
  using WS = WorkspaceLayout;
  using C = Consumers<WARPS, KSPLIT>;
  extern __shared__ __align__(128) unsigned char smem[];
  const Lane lane;
  const int warp = threadIdx.x / 32;
  const int group = warp / KSPLIT, kh = warp % KSPLIT;  // V group, K half
  // Every lane releases where K is split too (four consumer warps, but no spill at 128
  // registers; with one lane a warp racecheck reported the stage refills as racing with the
  // other lanes' reads, H200, 2026-12-04, run 79).
  using Pipe = Pipeline<WARPS, kStages, (WARPS < 4), 33, C::kWarps>;
  const ChainSlice<WARPS> cs(p, group);
  const int64_t n = cs.n, h = cs.h, bos = cs.bos, eos = cs.eos, num_chunks = cs.num_chunks;
  const int v_warp = cs.v_warp;
  const auto tile_of = [kh](int jl) { return C::tile(jl, kh); };

  float St[C::kTiles][4];  // S^T rows v_warp..+15; tile jl holds key channels 8j..8j+7, j = tile_of(jl)
  const StateOffsets state_offset(p, v_warp, lane);
  const int64_t state_base = cs.nh * kHeadDim * kHeadDim;
  if (warp < C::kWarps) load_state(St, p, state_offset, lane, state_base, tile_of);

  __shared__ uint64_t full[kStages], empty[kStages];
  Pipe pipe(full, empty);
  if (warp == C::kWarps) {
    pipe.template produce<false>(p, cs, smem);
    return;
  }
  __nv_bfloat16* out_tile = reinterpret_cast<__nv_bfloat16*>(smem + kStages * Stage<WARPS>::kBytes +
                                                             warp * Stage<WARPS>::kOutBytes);
  float4* exchange = reinterpret_cast<float4*>(smem + kStages * Stage<WARPS>::kBytes +
                                               C::kWarps * Stage<WARPS>::kOutBytes) +
                     group * C::kExchangeFloat4s;

  // The training forward's checkpoints: the float32 state entering every kCheckpointChunks-th
  // chunk, [rows, H, V, K] (as kda/triton/recurrence.py writes them), this warp's 16 V rows.
  float* checkpoint = nullptr;
  if (p.flags & kStoreCheckpoints)
    checkpoint = p.checkpoints + (p.checkpoint_offsets[n] * p.heads + h) * (kHeadDim * kHeadDim) +
                 (v_warp + lane.g) * kHeadDim + 2 * lane.t;
  for (int64_t i = 0; i < num_chunks; ++i, pipe.next()) {
    if (checkpoint != nullptr && i % kCheckpointChunks == 0) {
      // Elements e = 0, 1 of tile j are key channels 8j + 2t, +1 of row g; e = 2, 3 row g + 8.
      for (int jl = 0; jl < C::kTiles; ++jl) {
        const int j = tile_of(jl);
        *reinterpret_cast<float2*>(checkpoint + 8 * j) = make_float2(St[jl][0], St[jl][1]);
        *reinterpret_cast<float2*>(checkpoint + 8 * kHeadDim + 8 * j) = make_float2(St[jl][2], St[jl][3]);
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
    // ldmatrix.trans. Where v is taken as zeros (kVZero) no v tile was loaded, and every row
    // is masked as past the end: zeros. (A branch around these MMAs instead cost the 4-warp
    // width an 8-byte spill at its 128-register cap, nvcc 13.0, 2026-12-03.) Both warps of a
    // split pair form it, the same bits.
    float VB[2][4] = {};
    uint32_t aV[4];
    const int64_t v_rows = (p.flags & kVZero) ? 0 : eos - bos - i * kChunk;
    token_tile_operand(aV, v_tile, Stage<WARPS>::kVRowStride, group * 16, lane, v_rows);
    for (int nt = 0; nt < 2; ++nt) {
      const int row = (8 * nt + lane.g) * (kChunk / 2) + lane.t;  // 32-bit words, row-major [16, 16]
      mma_bf16(VB[nt], aV, ib_hi[row], ib_hi[row + 4]);
      mma_bf16(VB[nt], aV, ib_lo[row], ib_lo[row + 4]);
    }

    // S^T w^T (on the serial chain) and S^T q_decayed^T (for O^T) take the same left operand:
    // each 16-column step of S^T is converted once and used at once, so no copy of S^T as
    // bf16 stays live (registers decide how many CTAs an SM holds). S^T w^T runs as two
    // accumulator chains, even and odd steps kk, half as deep; a split pair's warp kh runs
    // chain kh.
    constexpr int kChains = 2 / KSPLIT;
    float P[kChains][2][4] = {};
    float O[2][4] = {};
    for (int m = 0; m < 8 / KSPLIT; ++m) {
      const int kk = KSPLIT * m + kh;
      uint32_t aS[4], bw[4], bq[4];
      accumulators_to_operand(aS, St[2 * m], St[2 * m + 1]);
      ldmatrix_x4(bw, tile_w + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
      mma_bf16(P[m % kChains][0], aS, bw[0], bw[1]);
      mma_bf16(P[m % kChains][1], aS, bw[2], bw[3]);
      ldmatrix_x4(bq, tile_qd + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
      mma_bf16(O[0], aS, bq[0], bq[1]);
      mma_bf16(O[1], aS, bq[2], bq[3]);
    }
    // U^T = V^T inverse_beta^T - S^T w^T.
    float U[2][4];
    if constexpr (KSPLIT == 1) {
      for (int nt = 0; nt < 2; ++nt)
        for (int e = 0; e < 4; ++e) U[nt][e] = VB[nt][e] - (P[0][nt][e] + P[1][nt][e]);
    } else {
      // Sums of two: a + b is b + a in float32, so each warp adds its own half to its partner's.
      float4* mine = exchange + ((i & 1) * KSPLIT + kh) * (3 * 32) + lane.l;
      const float4* theirs = exchange + ((i & 1) * KSPLIT + (1 - kh)) * (3 * 32) + lane.l;
      float sent[4];  // the partner's n-tile of this warp's S^T q_decayed^T
      for (int e = 0; e < 4; ++e) sent[e] = kh == 0 ? O[1][e] : O[0][e];
      mine[0] = make_float4(P[0][0][0], P[0][0][1], P[0][0][2], P[0][0][3]);
      mine[32] = make_float4(P[0][1][0], P[0][1][1], P[0][1][2], P[0][1][3]);
      mine[64] = make_float4(sent[0], sent[1], sent[2], sent[3]);
      pair_barrier(group);
      const float4 t0 = theirs[0], t1 = theirs[32], to = theirs[64];
      const float other[2][4] = {{t0.x, t0.y, t0.z, t0.w}, {t1.x, t1.y, t1.z, t1.w}};
      for (int nt = 0; nt < 2; ++nt)
        for (int e = 0; e < 4; ++e) U[nt][e] = VB[nt][e] - (P[0][nt][e] + other[nt][e]);
      // n-tile kh of S^T q_decayed^T, the even steps' sum plus the odd steps', into O[0]
      const float other_o[4] = {to.x, to.y, to.z, to.w};
      for (int e = 0; e < 4; ++e) O[0][e] = (kh == 0 ? O[0][e] : O[1][e]) + other_o[e];
    }
    uint32_t aU[4];
    accumulators_to_operand(aU, U[0], U[1]);

    // S^T_next = S^T Diag(gamma) + U^T k_restored (k_restored is row-major: ldmatrix.trans).
    scale_by_gamma(St, gamma, lane, tile_of);
    for (int m = 0; m < 8 / KSPLIT; ++m) {
      const int jp = KSPLIT * m + kh;
      uint32_t bk[4];
      ldmatrix_x4_trans(bk, tile_kr + tile_offset(r_lo + 8 * sel_a, 8 * (2 * jp + sel_b)));
      mma_bf16(St[2 * m], aU, bk[0], bk[1]);
      mma_bf16(St[2 * m + 1], aU, bk[2], bk[3]);
    }

    // O^T += U^T M^T (a split pair's warp kh: its n-tile, tokens 8 kh .. 8 kh + 7, held in O[0]).
    constexpr int kOutTiles = 2 / KSPLIT;
    for (int nt = 0; nt < kOutTiles; ++nt) {
      const int row = (8 * (nt + kh) + lane.g) * (kChunk / 2) + lane.t;
      mma_bf16(O[nt], aU, M[row], M[row + 4]);
    }
    pipe.release(lane);
    // O^T through shared memory, so that each token's 16 values leave as one 32-byte row.
    for (int nt = 0; nt < kOutTiles; ++nt)
      for (int e = 0; e < 4; ++e)
        out_tile[(8 * (nt + kh) + 2 * lane.t + e % 2) * 16 + lane.g + 8 * (e / 2)] = __float2bfloat16_rn(O[nt][e]);
    __syncwarp();
    if (KSPLIT == 1 || lane.l / 16 == 0) {
      const int piece = KSPLIT == 1 ? lane.l : 16 * kh + lane.l;  // 16-byte piece: token piece / 2, half piece % 2
      const int64_t tok = bos + i * kChunk + piece / 2;
      if (tok < eos)
        *reinterpret_cast<uint4*>(p.o + (tok * p.heads + h) * kHeadDim + v_warp + 8 * (piece % 2)) =
            reinterpret_cast<const uint4*>(out_tile)[piece];
    }
    __syncwarp();
  }

  store_state(St, p, state_offset, lane, state_base, tile_of);
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
// (store_ht); checkpoints = dS of every chunk, bf16 [num_chunks, H, 128 (V), 128 (K)], each
// (chunk, head) block's rows stored swizzled as K1's tiles (tile_offset: the state products'
// one bulk copy of a block then feeds conflict-free ldmatrix reads; the Triton state kernel
// reads it so with K1_LAYOUT). M enters in bf16 (the Triton chain's is float32 at tf32).
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
    {  // dS leaving chunk c, [c, h, v, k]: elements e = 0, 1 of tile j are key channels 8j + 2t, +1 of
       // row g; e = 2, 3 row g + 8 (same row % 8); piece j of a row is stored at piece j ^ (row % 8)
      unsigned char* at =
          reinterpret_cast<unsigned char*>(dstates + ((c_first + c) * p.heads + h) * (kHeadDim * kHeadDim));
      for (int j = 0; j < 16; ++j) {
        const int k = 8 * j + 2 * lane.t;
        *reinterpret_cast<uint32_t*>(at + tile_offset(v_warp + lane.g, k)) = pack_bf16(dSt[j][0], dSt[j][1]);
        *reinterpret_cast<uint32_t*>(at + tile_offset(v_warp + lane.g + 8, k)) = pack_bf16(dSt[j][2], dSt[j][3]);
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
    // (load_stage loads no rows under kVZero: then dO is zeros, as K2 takes v.)
    token_tile_operand(aO, do_tile, Stage<WARPS>::kVRowStride, warp * 16, lane,
                       (p.flags & kVZero) ? 0 : cs.eos - cs.bos - c * kChunk);
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

// ---- The training backward's state products ------------------------------------------------
//
// Per (chunk, head) the backward needs the products of the state S entering the chunk and of the
// gradient dS of the state leaving it with the chunk's operands, summed over V
// (reference.recurrence_step_backward, kda/triton/chunk_grad.py's chunk_state_grads_kernel and
// chunk_du_grads_kernel, which this kernel replaces on K1's workspace):
//
//     U     = inverse_beta V - w S              dU    = M^T dO + k_restored dS
//     dQ~   = dO S^T       [16, K]              dw    = -dU S^T         dK^ = U dS^T
//     dgamma = rowsum(S * dS)  [K]               dV    = inverse_beta^T dU
//     dU V^T, dO V^T       [16, 16]
//
// A (checkpoint span of kCheckpointChunks chunks, head) is one work item; a CTA (one an SM: its
// shared memory) takes items blockIdx.x, + gridDim.x, ... Eight consumer warps hold the 128 V
// rows of S^T (16 each, K2's registers) from the span's checkpoint and step it through the
// span's chunks as K2 does, so no state is recomputed twice; a producer warp streams each
// chunk's workspace block, v and dO rows and dS block into a pipeline stage, running ahead
// across items (the pipeline never drains between them) and asking L2 for each item's
// checkpoint as it starts the item's loads. Each warp forms U^T and dU^T for its V rows and
// leaves its share of the sums over V in shared memory as MMA fragments (S^T as bf16 right
// operands, U and dU as left operands, transposed in registers by movmatrix); after a barrier
// among the consumers, warp w forms the three [16, K] products for key channels 16w..16w+15
// with V as the MMA's reduction dimension, so the sums over V never leave the tensor cores;
// a second barrier frees the fragments for the next chunk. Params fields as read here: q = dO
// (bf16, v's shape), h0 = dS of every chunk (bf16 [num_chunks, H, 128 (V), 128 (K)], the
// reverse chain's, rows swizzled as K1's tiles), checkpoints = the training forward's (float32
// [rows, H, 128 (V), 128 (K)]), o = dV (bf16, v's shape), ht = the float32 scratch of the
// local-gradient kernel that follows: dQ~, dw, dK^ as [3, num_chunks, H, 16, 128], then dU
// V^T, dO V^T as [2, num_chunks, H, 16, 16], then dgamma [num_chunks, H, 128]; num_seqs and
// checkpoint_offsets say which items are real.
// Products take bf16 operands with float32 accumulation, as the Triton kernels' (MIXED); dU
// enters dU V^T and dV as a bf16 pair (hi + lo), where the Triton kernel's products were
// float32-accurate (DU_PRECISION).
struct ProductLayout {
  // a pipeline stage: the workspace block, v rows, dO rows (padded to kProductRowBytes, so that
  // the eight rows an ldmatrix reads fall in distinct bank groups), the dS block as stored
  static constexpr int kV = kWorkspaceBytes;
  static constexpr int kDo = kV + kChunk * kProductRowBytes;
  static constexpr int kDs = kDo + kChunk * kProductRowBytes;
  static constexpr int kDsBytes = kHeadDim * kHeadDim * 2;
  static constexpr int kStageBytes = kDs + kDsBytes;
  // the fragments: S^T's right operands [warp][n-tile][lane] (uint2), U's, dU's hi and lo left
  // operands [warp][lane] (uint4), each warp's dgamma partials [warp][K] (float)
  static constexpr int kS = 0;
  static constexpr int kU = kS + kHeadDim * kHeadDim * 2;
  static constexpr int kDuHi = kU + kProductWarps * 32 * 16;
  static constexpr int kDuLo = kDuHi + kProductWarps * 32 * 16;
  static constexpr int kGamma = kDuLo + kProductWarps * 32 * 16;
  static constexpr int kOperandBytes = kGamma + kProductWarps * kHeadDim * 4;
  static constexpr int kOperands = kProductStages * kStageBytes;
  static constexpr int kOut = kOperands + kOperandBytes;  // per warp: dV^T staged as [16 tokens, 16 v] bf16
  static constexpr int kBytes = kOut + kProductWarps * kChunk * 16 * 2;
};
static_assert(ProductLayout::kBytes == kProductsSharedBytes, "the products' shared memory differs from src/kda/abi.py");
static_assert(kProductWarps * 16 == kHeadDim, "the consumer warps cover V");

// One work item of the state products: checkpoint row `row` (of sequence n), head h, its chunks.
struct ProductSpan {
  int64_t row, h, bos, eos, c_seq, first;  // first: the span's first chunk within the sequence
  int chunks;
  // Item `item` (row-major over (checkpoint row, head)); false past the real rows.
  __device__ bool find(const Params& p, int64_t item) {
    row = item / p.heads;
    h = item % p.heads;
    if (row >= p.checkpoint_offsets[p.num_seqs]) return false;
    int64_t n = 0, last = p.num_seqs - 1;  // the last sequence whose first checkpoint row is <= row
    while (n < last) {
      const int64_t mid = (n + last + 1) / 2;
      if (p.checkpoint_offsets[mid] <= row) n = mid;
      else last = mid - 1;
    }
    bos = p.seq_offsets[n];
    eos = p.seq_offsets[n + 1];
    c_seq = p.chunk_offsets[n];
    first = (row - p.checkpoint_offsets[n]) * kCheckpointChunks;
    chunks = static_cast<int>(min(static_cast<int64_t>(kCheckpointChunks), p.chunk_offsets[n + 1] - c_seq - first));
    return true;
  }
  __device__ int rows(int i) const {
    return static_cast<int>(min(static_cast<int64_t>(kChunk), eos - bos - (first + i) * kChunk));
  }
  __device__ int64_t slot(const Params& p, int i) const { return (c_seq + first + i) * p.heads + h; }
};

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// The left operand of X^T from the left operand a of a [16, 16] block X: block (r, c) of X^T
// is block (c, r) of X transposed (registers 0-3: blocks (0, 0), (1, 0), (0, 1), (1, 1)).
__device__ __forceinline__ uint4 transposed_operand(const uint32_t (&a)[4]) {
  return make_uint4(transpose_8x8(a[0]), transpose_8x8(a[2]), transpose_8x8(a[1]), transpose_8x8(a[3]));
}

// The bf16 remainder of two accumulator tiles after their bf16 rounding (the lo of a hi + lo pair).
__device__ __forceinline__ void operand_remainder(uint32_t (&lo)[4], const float (&c0)[4], const float (&c1)[4]) {
  float r[2][4];
  for (int e = 0; e < 4; ++e) {
    r[0][e] = c0[e] - __bfloat162float(__float2bfloat16_rn(c0[e]));
    r[1][e] = c1[e] - __bfloat162float(__float2bfloat16_rn(c1[e]));
  }
  accumulators_to_operand(lo, r[0], r[1]);
}

// Rows (tokens) at or past ``rows`` of a left operand read from a staged token tile hold stale
// bytes: zero them (registers 0, 2 hold row g; 1, 3 row g + 8).
__device__ __forceinline__ void mask_token_rows(uint32_t (&a)[4], const Lane& lane, int rows) {
  if (lane.g >= rows) a[0] = a[2] = 0u;
  if (lane.g + 8 >= rows) a[1] = a[3] = 0u;
}

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kProductWarps) : "memory");
}

__device__ __forceinline__ void state_products(const Params& p) {
  using WS = WorkspaceLayout;
  using L = ProductLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  const Lane lane;
  const int warp = threadIdx.x / 32;
  const __nv_bfloat16* const dO = p.q;
  const unsigned char* const dstates = static_cast<const unsigned char*>(p.h0);

  __shared__ uint64_t full[kProductStages], empty[kProductStages];
  // every lane releases a stage (racecheck follows no __syncwarp: with one lane a warp it reported
  // the refills as racing with the other lanes' reads, H200, 2026-12-02, run 42)
  Pipeline<kProductWarps, kProductStages, true, 1> pipe(full, empty);
  ProductSpan span;
  if (warp == kProductWarps) {  // the producer: one bulk copy per block and per row
    int64_t loads = 0;
    for (int64_t item = blockIdx.x; span.find(p, item); item += gridDim.x) {
      if (lane.l < 4) {  // the item's checkpoint, 64 KB, into L2 ahead of the consumers' loads (16 KB a lane)
        const float* quarter = p.checkpoints + (span.row * p.heads + span.h) * (kHeadDim * kHeadDim) +
                               lane.l * (kHeadDim * kHeadDim / 4);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(quarter), "n"(kHeadDim * kHeadDim) : "memory");
      }
      for (int i = 0; i < span.chunks; ++i, ++loads, pipe.next()) {
        if (loads >= kProductStages) mbarrier_wait(empty[pipe.stage], pipe.round_parity ^ 1);
        const int64_t t0 = span.bos + (span.first + i) * kChunk, slot = span.slot(p, i);
        const int rows = span.rows(i);
        unsigned char* stage = smem + pipe.stage * L::kStageBytes;
        uint64_t& bar = full[pipe.stage];
        if (lane.l == 0) {
          cute::set_barrier_transaction_bytes(bar, kWorkspaceBytes + L::kDsBytes + 2 * rows * kHeadDim * 2);
          cute::SM90_BULK_COPY_G2S::copy(p.workspace + slot * kWorkspaceBytes, &bar, stage, kWorkspaceBytes);
          cute::SM90_BULK_COPY_G2S::copy(dstates + slot * L::kDsBytes, &bar, stage + L::kDs, L::kDsBytes);
        }
        __syncwarp();  // the expected byte count is posted before any row copy can complete
        if (lane.l < rows) {
          const int64_t at = ((t0 + lane.l) * p.heads + span.h) * kHeadDim;
          cute::SM90_BULK_COPY_G2S::copy(p.v + at, &bar, stage + L::kV + lane.l * kProductRowBytes, kHeadDim * 2);
          cute::SM90_BULK_COPY_G2S::copy(dO + at, &bar, stage + L::kDo + lane.l * kProductRowBytes, kHeadDim * 2);
        }
      }
    }
    return;
  }

  const int v_warp = 16 * warp;
  float* const operand_grads = static_cast<float*>(p.ht);  // [3, num_chunks, H, 16, 128]
  const int64_t plane = p.num_chunks * p.heads * (kChunk * kHeadDim);
  float* const squares = operand_grads + 3 * plane;  // [2, num_chunks, H, 16, 16]
  const int64_t square_plane = p.num_chunks * p.heads * (kChunk * kChunk);
  float* const gamma_grads = squares + 2 * square_plane;  // [num_chunks, H, 128]
  unsigned char* const ops = smem + L::kOperands;
  uint2* const s_frag = reinterpret_cast<uint2*>(ops + L::kS);
  uint4* const u_frag = reinterpret_cast<uint4*>(ops + L::kU);
  uint4* const du_hi = reinterpret_cast<uint4*>(ops + L::kDuHi);
  uint4* const du_lo = reinterpret_cast<uint4*>(ops + L::kDuLo);
  float* const gamma_part = reinterpret_cast<float*>(ops + L::kGamma);
  __nv_bfloat16* const out_tile = reinterpret_cast<__nv_bfloat16*>(smem + L::kOut + warp * (kChunk * 16 * 2));
  const int r_lo = lane.l & 7, sel_a = (lane.l >> 3) & 1, sel_b = (lane.l >> 4) & 1;

  for (int64_t item = blockIdx.x; span.find(p, item); item += gridDim.x) {
    float St[16][4];  // S^T rows v_warp..+15 from the span's checkpoint; tile j holds key channels 8j..8j+7
    {
      const float* at = p.checkpoints + (span.row * p.heads + span.h) * (kHeadDim * kHeadDim) +
                        (v_warp + lane.g) * kHeadDim + 2 * lane.t;
      for (int j = 0; j < 16; ++j) {
        const float2 a = *reinterpret_cast<const float2*>(at + 8 * j);
        const float2 b = *reinterpret_cast<const float2*>(at + 8 * kHeadDim + 8 * j);
        St[j][0] = a.x, St[j][1] = a.y, St[j][2] = b.x, St[j][3] = b.y;
      }
    }
    for (int i = 0; i < span.chunks; ++i, pipe.next()) {
      const int64_t t0 = span.bos + (span.first + i) * kChunk, slot = span.slot(p, i);
      const int rows = span.rows(i);
      pipe.wait_full();

      const unsigned char* st = smem + pipe.stage * L::kStageBytes;
      const unsigned char* tile_w = st + WS::w;
      const unsigned char* tile_kr = st + WS::k_restored;
      const uint32_t* ib_hi = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_hi);
      const uint32_t* ib_lo = reinterpret_cast<const uint32_t*>(st + WS::inverse_beta_lo);
      const float2* gamma = reinterpret_cast<const float2*>(st + WS::gamma);
      const unsigned char* v_tile = st + L::kV;
      const unsigned char* do_tile = st + L::kDo;
      const unsigned char* ds_tile = st + L::kDs;  // dS^T [V, K], rows swizzled (tile_offset)

      // V^T inverse_beta^T, as K2.
      float VB[2][4] = {};
      uint32_t aV[4];
      token_tile_operand(aV, v_tile, kProductRowBytes, v_warp, lane, rows);
      for (int nt = 0; nt < 2; ++nt) {
        const int r = (8 * nt + lane.g) * (kChunk / 2) + lane.t;
        mma_bf16(VB[nt], aV, ib_hi[r], ib_hi[r + 4]);
        mma_bf16(VB[nt], aV, ib_lo[r], ib_lo[r + 4]);
      }

      // S^T w^T as K2; on the way, S^T's right operands for the products (block (v, k) of S^T,
      // transposed, is register b0 (v 0-7) or b1 (v 8-15) of n-tile k) and this warp's share of
      // dgamma = rowsum(S * dS), summed over its V rows (lanes of one t) by shuffles.
      float P[2][2][4] = {};
      for (int kk = 0; kk < 8; ++kk) {
        uint32_t aS[4], bw[4];
        accumulators_to_operand(aS, St[2 * kk], St[2 * kk + 1]);
        ldmatrix_x4(bw, tile_w + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
        mma_bf16(P[kk % 2][0], aS, bw[0], bw[1]);
        mma_bf16(P[kk % 2][1], aS, bw[2], bw[3]);
        s_frag[(warp * 16 + 2 * kk) * 32 + lane.l] = make_uint2(transpose_8x8(aS[0]), transpose_8x8(aS[1]));
        s_frag[(warp * 16 + 2 * kk + 1) * 32 + lane.l] = make_uint2(transpose_8x8(aS[2]), transpose_8x8(aS[3]));
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * kk + jj, k = 8 * j + 2 * lane.t;
          const unsigned char* row0 = ds_tile + tile_offset(v_warp + lane.g, k);
          const unsigned char* row8 = ds_tile + tile_offset(v_warp + lane.g + 8, k);
          const float2 d0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row0));
          const float2 d1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row8));
          float x = St[j][0] * d0.x + St[j][2] * d1.x, y = St[j][1] * d0.y + St[j][3] * d1.y;
          for (int m = 4; m < 32; m *= 2) {
            x += __shfl_xor_sync(0xffffffffu, x, m);
            y += __shfl_xor_sync(0xffffffffu, y, m);
          }
          if (lane.g == 0) *reinterpret_cast<float2*>(gamma_part + warp * kHeadDim + k) = make_float2(x, y);
        }
      }
      // U^T = V^T inverse_beta^T - S^T w^T; U as a left operand for the products.
      float U[2][4];
      for (int nt = 0; nt < 2; ++nt)
        for (int e = 0; e < 4; ++e) U[nt][e] = VB[nt][e] - (P[0][nt][e] + P[1][nt][e]);
      uint32_t aU[4];
      accumulators_to_operand(aU, U[0], U[1]);
      u_frag[warp * 32 + lane.l] = transposed_operand(aU);

      // dU^T = dO^T M + dS^T k_restored^T, as the reverse chain's, with dS^T from the stage.
      float dU[2][4] = {};
      {
        uint32_t aO[4], bM[4];
        token_tile_operand(aO, do_tile, kProductRowBytes, v_warp, lane, rows);
        ldmatrix_x4_trans(bM, st + WS::M + (r_lo + 8 * sel_a) * (kChunk * 2) + 8 * sel_b * 2);
        mma_bf16(dU[0], aO, bM[0], bM[1]);
        mma_bf16(dU[1], aO, bM[2], bM[3]);
      }
      {
        float Q[2][2][4] = {};
        for (int kk = 0; kk < 8; ++kk) {
          uint32_t aD[4], bk[4];
          ldmatrix_x4(aD, ds_tile + tile_offset(v_warp + r_lo + 8 * sel_a, 16 * kk + 8 * sel_b));
          ldmatrix_x4(bk, tile_kr + tile_offset(r_lo + 8 * sel_b, 8 * (2 * kk + sel_a)));
          mma_bf16(Q[kk % 2][0], aD, bk[0], bk[1]);
          mma_bf16(Q[kk % 2][1], aD, bk[2], bk[3]);
        }
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e) dU[nt][e] += Q[0][nt][e] + Q[1][nt][e];
      }
      uint32_t aDh[4], aDl[4];
      accumulators_to_operand(aDh, dU[0], dU[1]);
      operand_remainder(aDl, dU[0], dU[1]);
      du_hi[warp * 32 + lane.l] = transposed_operand(aDh);
      du_lo[warp * 32 + lane.l] = transposed_operand(aDl);

      // dV^T = dU^T inverse_beta (inverse_beta as stored is the right operand, by ldmatrix.trans),
      // both as bf16 pairs; through shared memory, so each token's 16 values leave as one row.
      {
        float dV[2][4] = {};
        uint32_t bh[4], bl[4];
        const int at = (r_lo + 8 * sel_a) * (kChunk * 2) + 8 * sel_b * 2;
        ldmatrix_x4_trans(bh, st + WS::inverse_beta_hi + at);
        ldmatrix_x4_trans(bl, st + WS::inverse_beta_lo + at);
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16(dV[nt], aDl, bh[2 * nt], bh[2 * nt + 1]);
          mma_bf16(dV[nt], aDh, bl[2 * nt], bl[2 * nt + 1]);
          mma_bf16(dV[nt], aDh, bh[2 * nt], bh[2 * nt + 1]);
        }
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e)
            out_tile[(8 * nt + 2 * lane.t + e % 2) * 16 + lane.g + 8 * (e / 2)] = __float2bfloat16_rn(dV[nt][e]);
        __syncwarp();
        if (lane.l / 2 < rows)
          *reinterpret_cast<uint4*>(p.o + ((t0 + lane.l / 2) * p.heads + span.h) * kHeadDim + v_warp +
                                    8 * (lane.l % 2)) = reinterpret_cast<const uint4*>(out_tile)[lane.l];
        __syncwarp();
      }

      // S^T_next = S^T Diag(gamma) + U^T k_restored, as K2.
      scale_by_gamma(St, gamma, lane);
      for (int jp = 0; jp < 8; ++jp) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, tile_kr + tile_offset(r_lo + 8 * sel_a, 8 * (2 * jp + sel_b)));
        mma_bf16(St[2 * jp], aU, bk[0], bk[1]);
        mma_bf16(St[2 * jp + 1], aU, bk[2], bk[3]);
      }

      consumer_barrier();  // every warp's fragments and dgamma partials of this chunk are in

      // Key channels 16 warp .. +15 (n-tiles 2 warp, 2 warp + 1) of the three products, the sum
      // over V as the reduction dimension: V rows 16 wv .. +15 are warp wv's fragments.
      float dQ[2][4] = {}, dW[2][4] = {}, dK[2][4] = {};
      for (int wv = 0; wv < kProductWarps; ++wv) {
        uint32_t aO[4], bD[4];
        ldmatrix_x4(aO, do_tile + (r_lo + 8 * sel_a) * kProductRowBytes + (16 * wv + 8 * sel_b) * 2);
        mask_token_rows(aO, lane, rows);
        const uint4 u = u_frag[wv * 32 + lane.l], d = du_hi[wv * 32 + lane.l];
        const uint32_t aUw[4] = {u.x, u.y, u.z, u.w}, aDw[4] = {d.x, d.y, d.z, d.w};
        ldmatrix_x4_trans(bD, ds_tile + tile_offset(16 * wv + r_lo + 8 * sel_a, 16 * warp + 8 * sel_b));
        for (int nt = 0; nt < 2; ++nt) {
          const uint2 sf = s_frag[(wv * 16 + 2 * warp + nt) * 32 + lane.l];
          mma_bf16(dQ[nt], aO, sf.x, sf.y);
          mma_bf16(dW[nt], aDw, sf.x, sf.y);
          mma_bf16(dK[nt], aUw, bD[2 * nt], bD[2 * nt + 1]);
        }
      }
      float gamma_sum = 0.f;
      if (lane.l < 16)
        for (int wv = 0; wv < kProductWarps; ++wv) gamma_sum += gamma_part[wv * kHeadDim + 16 * warp + lane.l];
      // dU V^T (warps 0, 1: n-tile = warp, dU as hi + lo) and dO V^T (warps 2, 3), summed over V;
      // V^T is the right operand as v's rows are stored (ldmatrix), tokens past the end zeroed.
      float X[4] = {};
      if (warp < 4) {
        const int nt = warp % 2;
        const bool zero_b = 8 * nt + lane.g >= rows;
        for (int wv = 0; wv < kProductWarps; ++wv) {
          uint32_t bV[4];
          ldmatrix_x4(bV, v_tile + (r_lo + 8 * sel_b) * kProductRowBytes + (16 * wv + 8 * sel_a) * 2);
          const uint32_t b0 = zero_b ? 0u : bV[2 * nt], b1 = zero_b ? 0u : bV[2 * nt + 1];
          if (warp < 2) {
            const uint4 hi = du_hi[wv * 32 + lane.l], lo = du_lo[wv * 32 + lane.l];
            const uint32_t a_hi[4] = {hi.x, hi.y, hi.z, hi.w}, a_lo[4] = {lo.x, lo.y, lo.z, lo.w};
            mma_bf16(X, a_lo, b0, b1);
            mma_bf16(X, a_hi, b0, b1);
          } else {
            uint32_t aO[4];
            ldmatrix_x4(aO, do_tile + (r_lo + 8 * sel_a) * kProductRowBytes + (16 * wv + 8 * sel_b) * 2);
            mask_token_rows(aO, lane, rows);
            mma_bf16(X, aO, b0, b1);
          }
        }
      }
      consumer_barrier();  // every warp is done with this chunk's fragments: the next chunk's may land
      pipe.release(lane);

      for (int nt = 0; nt < 2; ++nt) {
        float* at = operand_grads + (slot * kChunk + lane.g) * kHeadDim + 16 * warp + 8 * nt + 2 * lane.t;
        *reinterpret_cast<float2*>(at) = make_float2(dQ[nt][0], dQ[nt][1]);
        *reinterpret_cast<float2*>(at + 8 * kHeadDim) = make_float2(dQ[nt][2], dQ[nt][3]);
        *reinterpret_cast<float2*>(at + plane) = make_float2(-dW[nt][0], -dW[nt][1]);
        *reinterpret_cast<float2*>(at + plane + 8 * kHeadDim) = make_float2(-dW[nt][2], -dW[nt][3]);
        *reinterpret_cast<float2*>(at + 2 * plane) = make_float2(dK[nt][0], dK[nt][1]);
        *reinterpret_cast<float2*>(at + 2 * plane + 8 * kHeadDim) = make_float2(dK[nt][2], dK[nt][3]);
      }
      if (lane.l < 16) gamma_grads[slot * kHeadDim + 16 * warp + lane.l] = gamma_sum;
      if (warp < 4) {
        float* at = squares + (warp < 2 ? 0 : square_plane) + (slot * kChunk + lane.g) * kChunk + 8 * (warp % 2) +
                    2 * lane.t;
        *reinterpret_cast<float2*>(at) = make_float2(X[0], X[1]);
        *reinterpret_cast<float2*>(at + 8 * kChunk) = make_float2(X[2], X[3]);
      }
    }
  }
}

// ---- K2 on warpgroup MMAs (abi.WGMMA_*; 2026-12-04, runs 111-120) ---------------------------
//
// One warpgroup (four consumer warps, 64 V rows: S^T [64, 128] in wgmma accumulators, the same
// per-warp layout as the mma.sync tiles above) and a producer warp a CTA. The chain's two large
// products run on wgmma with S^T (and U^T) as the register operand: S^T [w; q_decayed]^T as
// eight m64n32k16 steps over K, and S^T += U^T k_restored as one m64n128k16. V^T inverse_beta^T
// and U^T M^T stay on mma.sync (per warp, 16 x 16). wgmma reads its B operand from shared memory
// in a canonical 128-byte-swizzled layout, which K1's twin entry point (prepare.cu
// kda_prepare_wgmma) stores its three tiles in (abi.WGMMA_TILES): [w; q_decayed] as two K halves
// of [32 rows, 128 B] (K-major), then k_restored as two N halves of [16 tokens, 128 B]
// (MN-major); the rest of the block is K1's usual. The stage is the usual pipeline's (the
// producer as in recurrence<4>), its stages 1024-byte aligned for the swizzle atoms.
//
// Why (H200, benchmarks/NOTES.md, runs 111-120): per SM a wgmma step takes about as long as an
// mma.sync step (about 1150 cycles in run 108, the fixed scalar costs of one warpgroup: conversions, the
// gamma scaling, arrivals) but covers 64 V rows instead of 32, and it draws less power (1x32768
// H32: 434 W against 662 W). It wins where its grid (two CTAs a pair) fills the GPU: 1x8192 H64
// (128 CTAs, one an SM) K2 0.307 against 0.406 ms; two CTAs an SM (kda_recurrence_wgmma_c2) on
// 1x8192 H96 0.468 against 0.482 and 1024x8 H96 0.415 against 0.460; and loses where the grid
// leaves SMs idle (1x32768 H32, 64 CTAs: 1.18 against 1.00).
namespace gmma = cute::SM90::GMMA;

// A 128-byte-swizzle descriptor: start address, leading and stride byte offsets.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t smem_address, int lbo, int sbo) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(smem_address >> 4);
  desc.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  desc.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = static_cast<uint8_t>(gmma::LayoutType::B128);
  return desc.desc_;
}

// ``desc`` with its start address moved by ``byte_offset``: a 32-bit add to the low word, which
// gives the 64-bit add's bits, as nothing carries past bit 31 (the low word holds the start
// address field, address / 16 in bits 0-13, then the leading byte offset; the moved address must
// stay inside the field either way, which recurrence_wgmma's static_assert checks). As a 64-bit
// add, ptxas spent a carry chain and moves on each of the chain's eight descriptors a step; this
// took K2 1-3% faster (H200, 2026-12-04, run 129, same bits).
__device__ __forceinline__ uint64_t gmma_desc_moved(uint64_t desc, int byte_offset) {
  uint64_t moved;
  asm("mov.b64 %0, {%1, %2};"
      : "=l"(moved)
      : "r"(static_cast<uint32_t>(desc) + (byte_offset >> 4)), "r"(static_cast<uint32_t>(desc >> 32)));
  return moved;
}

__device__ __forceinline__ void wgmma_64x32(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc, bool accumulate) {
  gmma::MMA_64x32x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>::fma(
      a[0], a[1], a[2], a[3], desc, d[0][0], d[0][1], d[0][2], d[0][3], d[1][0], d[1][1], d[1][2], d[1][3], d[2][0],
      d[2][1], d[2][2], d[2][3], d[3][0], d[3][1], d[3][2], d[3][3],
      accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

__device__ __forceinline__ void wgmma_64x128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) {
  gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>::fma(
      a[0], a[1], a[2], a[3], desc, d[0][0], d[0][1], d[0][2], d[0][3], d[1][0], d[1][1], d[1][2], d[1][3], d[2][0],
      d[2][1], d[2][2], d[2][3], d[3][0], d[3][1], d[3][2], d[3][3], d[4][0], d[4][1], d[4][2], d[4][3], d[5][0],
      d[5][1], d[5][2], d[5][3], d[6][0], d[6][1], d[6][2], d[6][3], d[7][0], d[7][1], d[7][2], d[7][3], d[8][0],
      d[8][1], d[8][2], d[8][3], d[9][0], d[9][1], d[9][2], d[9][3], d[10][0], d[10][1], d[10][2], d[10][3], d[11][0],
      d[11][1], d[11][2], d[11][3], d[12][0], d[12][1], d[12][2], d[12][3], d[13][0], d[13][1], d[13][2], d[13][3],
      d[14][0], d[14][1], d[14][2], d[14][3], d[15][0], d[15][1], d[15][2], d[15][3], gmma::ScaleOut::One);
}

// The registers a wgmma reads or writes may not be touched by other instructions while it runs:
// the fence keeps the compiler from moving their accesses across the arrive / wait.
template <int ROWS, int COLS>
__device__ __forceinline__ void fence_operands(float (&r)[ROWS][COLS]) {
  for (int i = 0; i < ROWS; ++i)
    for (int e = 0; e < COLS; ++e) cute::warpgroup_fence_operand(r[i][e]);
}

static_assert(kWgmmaStageBytes >= Stage<4>::kBytes && kWgmmaStageBytes % 1024 == 0, "a stage, 1024-byte aligned");
static_assert(kWgmmaTilesKr + kChunk * kHeadDim * 2 == WorkspaceLayout::inverse_beta_hi, "the tiles fill K1's three");
static_assert(WorkspaceLayout::inverse_beta_hi % 16 == 0 && WorkspaceLayout::inverse_beta_lo % 16 == 0 &&
                  WorkspaceLayout::M % 16 == 0,
              "ldmatrix rows are 16-byte aligned");

// CTAS: CTAs an SM (abi.WGMMA_STAGES: the pipeline's stages for that many). The step as it has
// been since 2026-12-05 (run 140, benchmarks/NOTES.md): the same MMAs in the same order from the
// same words as the step before it (the same bits: run 140's hashes, and its GPU test of both),
// with fewer instructions:
//   - inverse_beta (hi, lo) and M read as the mma.sync right operands by one ldmatrix.x4 each
//     (three shared loads a step for twelve 32-bit ones),
//   - the output tile written by one stmatrix.trans (for eight 16-bit stores and conversions),
//   - a lane's output row stored from a pointer advanced a chunk a step (for a 64-bit row address
//     recomputed every step), and 32-bit chunk and token counts,
//   - at one CTA an SM, the loop unrolled over the pipeline's stages, so that every stage's
//     shared-memory addresses and barriers are immediates (at two, 168 registers a thread leave
//     no room for it: it spilled; 2026-12-04, benchmarks/NOTES.md).
// Static SASS a step 311 -> 242 at one CTA an SM, 313 -> 270 at two (cuobjdump, nvcc 13.0); on the
// H200, K2 on 1x8192 H64 0.280 -> 0.214 ms, on 1x8192 H96 0.424 -> 0.371. A form without the
// producer warp (each warp refilling its own v columns, the warps taking turns at the workspace
// copy; 128 threads, so the two-CTA loop unrolls too) was slower (1x8192 H96 0.853 ms against
// 0.819 for the call; baf32fe).
template <int CTAS>
__device__ __forceinline__ void recurrence_wgmma(const Params& p, int64_t cta = blockIdx.x) {
  constexpr int kWgmmaStages = wgmma_stages(CTAS);
  static_assert(wgmma_shared_bytes(CTAS) == 1024 + kWgmmaStages * kWgmmaStageBytes + 4 * 2 * Stage<4>::kOutBytes,
                "abi.wgmma_shared_bytes lays out this kernel's shared memory");
  static_assert(wgmma_shared_bytes(CTAS) + 2048 <= (1 << 18),
                "every stage's tiles (after the static 1 KB and the alignment) within a descriptor's 14-bit "
                "start address field (address / 16)");
  using WS = WorkspaceLayout;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle is on shared-memory address bits: the atoms need 1024-byte alignment.
  unsigned char* smem = smem_raw + ((1024 - cute::cast_smem_ptr_to_uint(smem_raw) % 1024) % 1024);
  const Lane lane;
  const int warp = threadIdx.x / 32;
  const ChainSlice<4> cs(p, warp, cta);
  const int64_t h = cs.h, bos = cs.bos, eos = cs.eos, num_chunks = cs.num_chunks;
  const int v_warp = cs.v_warp;

  float St[16][4];
  const StateOffsets state_offset(p, v_warp, lane);
  const int64_t state_base = cs.nh * kHeadDim * kHeadDim;
  if (warp < 4) load_state(St, p, state_offset, lane, state_base);

  __shared__ uint64_t full[kWgmmaStages], empty[kWgmmaStages];
  Pipeline<4, kWgmmaStages, true, 33, 4> pipe(full, empty);
  if (warp == 4) {
    for (int64_t i = 0; i < num_chunks; ++i, pipe.next()) {
      if (i >= kWgmmaStages) mbarrier_wait(pipe.empty[pipe.stage], pipe.round_parity ^ 1);
      load_stage<4>(smem + pipe.stage * kWgmmaStageBytes, pipe.full[pipe.stage],
                    p.workspace + ((cs.c_first + i) * p.heads + h) * kWorkspaceBytes, p, bos + i * kChunk, cs.rows(i),
                    h, cs.v0);
    }
    cute::cp_async_wait<0>();
    return;
  }
  // Two output tiles a warp: chunk i's is written at its step's end and stored to o during step
  // i + 1, in the shadow of its wgmmas.
  __nv_bfloat16* out_tiles =
      reinterpret_cast<__nv_bfloat16*>(smem + kWgmmaStages * kWgmmaStageBytes + warp * 2 * Stage<4>::kOutBytes);
  // Lane l's output row (token l / 2 of the chunk, v columns 8 (l % 2) ..) as a pointer advanced a
  // chunk a store, and the tokens left from it. 32 bits hold a sequence's tokens: one of 2^31
  // would need 512 GB of v at one head.
  __nv_bfloat16* o_row = p.o + ((bos + lane.l / 2) * p.heads + h) * kHeadDim + v_warp + 8 * (lane.l % 2);
  const int64_t o_chunk_step = int64_t{kChunk} * p.heads * kHeadDim;
  int o_rows_left = static_cast<int>(eos - bos) - lane.l / 2;
  const auto store_output = [&](int64_t c) {  // chunk c's tile to o (the warp's 16 columns), c = 0, 1, ... in order
    __syncwarp();
    const uint4* tile = reinterpret_cast<const uint4*>(out_tiles + (c & 1) * (kChunk * 16));
    if (o_rows_left > 0) *reinterpret_cast<uint4*>(o_row) = tile[lane.l];
    o_row += o_chunk_step;
    o_rows_left -= kChunk;
    __syncwarp();
  };
  // The byte offset of the row that lane l addresses in an ldmatrix.x4 or stmatrix.x4 of a
  // [16, 16] 16-bit tile stored row-major (32 B a row): matrix m = l / 8 is rows 8 (m / 2) ..
  // + 7, columns 8 (m % 2) .. + 7. Over the [n, k] right-operand tiles (inverse_beta, M) it
  // gives register 2 nt + j = the b_j of n-tile nt (k 8 j + 2 t, + 1 of row n = 8 nt + g); over
  // the [token, v] output tile, stmatrix.trans takes register 2 nt + j as O^T's n-tile nt, rows
  // (v) 8 j .. (benchmarks/lane_maps.py checks both against 32-bit loads and 16-bit stores).
  const int quad_offset = ((lane.l / 16) * 8 + lane.l % 8) * 32 + ((lane.l / 8) % 2) * 16;

  // The v tokens from chunk 0 on (as o_rows_left): the partial-chunk mask's count.
  const int v_tokens = (p.flags & kVZero) ? 0 : static_cast<int>(eos - bos);
  const int chunks = static_cast<int>(num_chunks);

  // One chunk's step from stage ``stage`` (its full barrier in phase ``parity``).
  const auto step = [&](int i, int stage, int parity) {
    mbarrier_wait(full[stage], parity);
    const unsigned char* st = smem + stage * kWgmmaStageBytes;
    const uint32_t st_address = cute::cast_smem_ptr_to_uint(st);
    const float2* gamma = reinterpret_cast<const float2*>(st + WS::gamma);

    // S^T [w; q_decayed]^T: n-tiles 0, 1 the chain's S^T w^T, 2, 3 the output's S^T q_decayed^T.
    // The steps' descriptors differ in their start address alone (offset / 16 in the low bits):
    // step kk reads K columns 16 kk .. + 16, in K half kk / 4 (4096 B apart), 32 B a step within it.
    uint32_t aS[8][4];
    for (int m = 0; m < 8; ++m) accumulators_to_operand(aS[m], St[2 * m], St[2 * m + 1]);
    // S^T Diag(gamma) written before the chain's warpgroup.arrive, not after its wgmmas: there,
    // multiplying S^T (registers the last step's update wgmma defined) made ptxas (nvcc 13.0)
    // inject a warpgroup.wait (C7517), so V^T inverse_beta^T, the scaling and the output store
    // all waited for the chain. Written here, ptxas raises no note and itself schedules most of
    // the 64 multiplies beside the chain's HGMMAs (cuobjdump): the same bits, K2 4-8% faster on
    // the wgmma cases (H200, 2026-12-04, run 123, benchmarks/NOTES.md).
    scale_by_gamma(St, gamma, lane);
    const uint64_t desc_wq = gmma_desc(st_address + kWgmmaTilesWq, 16, 1024);
    float PO[4][4];
    fence_operands(PO);
    cute::warpgroup_arrive();
    for (int kk = 0; kk < 8; ++kk)
      wgmma_64x32(PO, aS[kk], gmma_desc_moved(desc_wq, (kk / 4) * 4096 + (kk % 4) * 32), kk > 0);
    cute::warpgroup_commit_batch();

    // While the chain's wgmmas run: V^T inverse_beta^T (mma.sync), the previous chunk's output to o.
    float VB[2][4] = {};
    uint32_t aV[4];
    const int64_t v_rows = v_tokens - i * kChunk;
    token_tile_operand(aV, st + kWorkspaceBytes, Stage<4>::kVRowStride, warp * 16, lane, v_rows);
    uint32_t b_hi[4], b_lo[4];
    ldmatrix_x4(b_hi, st + WS::inverse_beta_hi + quad_offset);
    ldmatrix_x4(b_lo, st + WS::inverse_beta_lo + quad_offset);
    for (int nt = 0; nt < 2; ++nt) {
      mma_bf16(VB[nt], aV, b_hi[2 * nt], b_hi[2 * nt + 1]);
      mma_bf16(VB[nt], aV, b_lo[2 * nt], b_lo[2 * nt + 1]);
    }
    if (i > 0) store_output(i - 1);
    cute::warpgroup_wait<0>();
    fence_operands(PO);

    float U[2][4];
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) U[nt][e] = VB[nt][e] - PO[nt][e];
    uint32_t aU[4];
    accumulators_to_operand(aU, U[0], U[1]);

    // O^T = S^T q_decayed^T + U^T M^T, before the update's wgmma reads aU (an HMMA reading
    // registers that an issued wgmma reads waited for it: 128 cycles a step, run 108).
    float O[2][4];
    uint32_t b_m[4];
    ldmatrix_x4(b_m, st + WS::M + quad_offset);
    for (int nt = 0; nt < 2; ++nt) {
      for (int e = 0; e < 4; ++e) O[nt][e] = PO[2 + nt][e];
      mma_bf16(O[nt], aU, b_m[2 * nt], b_m[2 * nt + 1]);
    }

    // S^T += U^T k_restored: one m64n128k16 (k_restored MN-major: N halves 2048 B apart, token
    // rows 8 apart by 1024 B).
    fence_operands(St);
    cute::warpgroup_arrive();
    wgmma_64x128(St, aU, gmma_desc(st_address + kWgmmaTilesKr, 2048, 1024));
    cute::warpgroup_commit_batch();
    __nv_bfloat16* out_tile = out_tiles + (i & 1) * (kChunk * 16);
    stmatrix_x4_trans(reinterpret_cast<unsigned char*>(out_tile) + quad_offset, pack_bf16(O[0][0], O[0][1]),
                      pack_bf16(O[0][2], O[0][3]), pack_bf16(O[1][0], O[1][1]), pack_bf16(O[1][2], O[1][3]));
    cute::warpgroup_wait<0>();
    fence_operands(St);
    mbarrier_arrive(empty[stage]);  // every lane releases (pipe.release, kLaneRelease)
  };
  static_assert(decltype(pipe)::kLaneRelease, "the step releases its stage from every lane");

  if constexpr (CTAS == 1) {
    // Unrolled over the stages: stage s of round r holds chunk r S + s, its barriers in phase r % 2.
    int parity = 0;
    for (int i0 = 0; i0 < chunks; i0 += kWgmmaStages, parity ^= 1) {
#pragma unroll
      for (int s = 0; s < kWgmmaStages; ++s)
        if (i0 + s < chunks) step(i0 + s, s, parity);
    }
  } else {
    for (int i = 0; i < chunks; ++i, pipe.next()) step(i, pipe.stage, pipe.round_parity);
  }
  if (num_chunks > 0) store_output(num_chunks - 1);

  store_state(St, p, state_offset, lane, state_base);
}

}  // namespace

// One entry point per width, each with one more warp, the producer. Registers are
// allocated per SM sub-partition (16384 each), so the cap decides how many CTAs an SM holds:
// at 168, three warps a sub-partition (two-warp CTAs: four an SM, eight consumer warps); at
// 128, four (four-warp CTAs: three an SM, twelve consumer warps). The loop needs no more
// than 128 without spilling; forward.recurrence_width picks the width (2026-11-30, commit 0f49568, run 3).
extern "C" __global__ void __maxnreg__(168) kda_recurrence_w1(const Params p) { recurrence<1>(p); }
extern "C" __global__ void __maxnreg__(168) kda_recurrence_w2(const Params p) { recurrence<2>(p); }
extern "C" __global__ void __maxnreg__(128) kda_recurrence_w4(const Params p) { recurrence<4>(p); }
// K split between two warps a V group (few chains: the calls where sub-partitions would idle),
// five warps a CTA; 128 registers, no spill.
extern "C" __global__ void __maxnreg__(128) kda_recurrence_w2k2(const Params p) { recurrence<2, 2>(p); }
// K2 on wgmma (abi.wgmma_kernel_name): one CTA an SM (243 registers, six stages), two (167
// registers under the bound's 204, four stages); no spills (nvcc 13.0, 2026-12-05).
extern "C" __global__ void __launch_bounds__(kWgmmaThreads, 1) kda_recurrence_wgmma_c1(const Params p) {
  recurrence_wgmma<1>(p);
}
extern "C" __global__ void __launch_bounds__(kWgmmaThreads, 2) kda_recurrence_wgmma_c2(const Params p) {
  recurrence_wgmma<2>(p);
}
// The segment split's two transition runs in one launch (kda.cuda.forward.chunk_forward_runs,
// abi.wgmma_runs_kernel_name): ``first`` and ``second`` differ in v, the states and the output
// only (K1's workspace is the same), and the grid interleaves them pair by pair, (first's V
// slices, second's V slices) of each (sequence, head) pair, so that the four CTAs reading a
// workspace block are resident together and the block comes from DRAM about once, where two
// launches read the whole workspace twice. Each CTA is K2 of its run as recurrence_wgmma, on
// its own Params (both inlined: a Params picked at run time would be addressed through memory).
template <int CTAS>
__device__ __forceinline__ void recurrence_wgmma_runs(const Params& first, const Params& second) {
  constexpr int kSlices = ChainSlice<4>::kSlices;
  const int64_t cta = blockIdx.x / (2 * kSlices) * kSlices + blockIdx.x % kSlices;
  if (blockIdx.x / kSlices % 2 == 0)
    recurrence_wgmma<CTAS>(first, cta);
  else
    recurrence_wgmma<CTAS>(second, cta);
}
extern "C" __global__ void __launch_bounds__(kWgmmaThreads, 1)
    kda_recurrence_wgmma_runs_c1(const Params first, const Params second) {
  recurrence_wgmma_runs<1>(first, second);
}
extern "C" __global__ void __launch_bounds__(kWgmmaThreads, 2)
    kda_recurrence_wgmma_runs_c2(const Params first, const Params second) {
  recurrence_wgmma_runs<2>(first, second);
}
// The training backward's reverse chain at K2's two narrow widths (abi.CHAIN_WIDTHS): at four
// warps and 128 registers it spilled 52 B (ptxas, nvcc 13.0, 2026-12-02).
extern "C" __global__ void __maxnreg__(168) kda_state_grad_chain_w1(const Params p) { state_grad_chain<1>(p); }
extern "C" __global__ void __maxnreg__(168) kda_state_grad_chain_w2(const Params p) { state_grad_chain<2>(p); }
// The state products: one CTA an SM (its shared memory), so the registers are not capped below
// what 288 threads may have.
extern "C" __global__ void __launch_bounds__(32 * (kProductWarps + 1), 1) kda_state_products(const Params p) {
  state_products(p);
}

}  // namespace kda
