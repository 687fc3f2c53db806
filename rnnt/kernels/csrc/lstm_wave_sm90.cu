// The encoder's LSTM stacks as waves of Hopper kernels (sm_90a: TMA, wgmma, clusters), forward and
// backward; rnnt/kernels/lstm_wave.py wires them into autograd and holds their plain-PyTorch twin.
//
// A launch (a "wave") runs several (layer, step) cells of the stack at once: the host schedule
// (wave_schedule) packs the cells whose inputs earlier launches wrote, as many as fit the SMs, so
// one launch does the work of several cuDNN steps. In the forward cell (l, t) needs (l, t - 1)
// and (l - 1, t); in the backward (l, t + 1) and (l + 1, t). Later launches use programmatic
// dependent launch. A layer whose input is wider than the hidden size gets x W_ih^T from one GEMM
// before the waves and runs W_hh alone.
//
// Active steps: where the caller passes a device count n (the batch's longest sequence inside a
// longer CUDA-graph bucket), cells at t >= n skip their GEMM and cell and write only zeros where
// later GEMMs read (h and dropout(h) forward; dz and the bias partials backward), and the backward
// starts its recursion at n - 1: what a stack of n steps computes, at the cost of an empty launch
// per padded step instead of a full one.
//
// Frame pairs: the last layer may store its output as the encoder's stacking of two frames reads
// it (steps 2u and 2u + 1 side by side, zero past each row's length), and the backward then reads
// its gradient in that layout: no copies between the encoder's stacks (wave_lstm_forward).
//
// Forward GEMM, per wave and layer: gates^T = W x [in(t), h(t - 1)]^T, tiled as cuBLAS tiles it
// (128 W rows x 96 batch rows, K slices of 64); the cell runs in the epilogue, which writes h,
// dropout(h) and six factor planes, so the backward needs neither the gates nor a c sequence:
//   A1 = o (1 - tanh^2 c), A2 = g i (1 - i), A3 = c(t - 1) f (1 - f), A4 = i (1 - g^2),
//   A5 = tanh(c) o (1 - o), A6 = f
//   dc = dh A1 + A6(t + 1) dc(t + 1),  dz = (dc A2, dc A3, dc A4, dh A5).
// Backward GEMM: dh^T = W^T x dz^T (64 units x 96 batch rows, K = 4H); below the top layer a
// cluster pair splits K between the recurrent part and the layer above's part. Its epilogue runs
// on both warp groups, half the units each (the producer's is idle once its loads are issued).
// Design, measurements and what did not pay: docs/PERFORMANCE.md.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90.cuh"

namespace wave {
using namespace sm90;

constexpr int HID = 1024;  // hidden size (N = 4 HID)

// TMA's swizzles as functions of a byte offset inside a 1024-byte-aligned tile
__host__ __device__ constexpr uint32_t swz128(uint32_t o) { return o ^ ((o >> 3) & 0x70); }
__host__ __device__ constexpr uint32_t swz64(uint32_t o) { return o ^ ((o >> 3) & 0x30); }

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < 48; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wgmma_m64n96k16(float* d, uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %50, 0; "
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "%48, %49, p, 1, 1, 0, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "l"(da), "l"(db), "r"(scale_d));
}
// One K slice of 16 into a 64 x 96 accumulator from 128-byte-swizzled tiles at shared addresses a
// (64 rows) and b (96 batch rows).
__device__ __forceinline__ void mma_64x96(float* d, uint32_t a, uint32_t b, int scale_d) {
  wgmma_m64n96k16(d, smem_desc(a), smem_desc(b), scale_d);
}
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float sigmoid_fast(float x) { return fmaf(0.5f, tanh_fast(0.5f * x), 0.5f); }
__host__ __device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
// Dropout keys (rnnt/kernels/lstm_wave.py's keep_mask is their reference): one seed per (layer,
// step), then one hash per pair of batch rows b, b + 1 (b even) of a unit, 16 bits per row. They do
// not depend on the batch size, so padding the batch leaves the real rows' masks as they are.
__host__ __device__ __forceinline__ uint32_t step_seed(uint32_t seed, int layer, int t) {
  return mix(mix(seed + 0x9e3779b9u * (layer + 1)) + 0x85ebca6bu * (t + 1));
}
__host__ __device__ __forceinline__ uint32_t drop_key(uint32_t step, uint32_t even_b, int unit) {
  return mix(step ^ ((even_b >> 1) * HID + unit));
}
__host__ __device__ __forceinline__ bool dropped(uint32_t key, int bit, uint32_t threshold) {
  return ((bit ? key >> 16 : key) & 0xFFFFu) < threshold;
}
// What one launch runs: up to MAX_JOBS (layer, step) cells of the stack, in CTA order; the host's
// schedule (wave_schedule) decides which, so that a launch fills the GPU once and no more.
constexpr int MAX_JOBS = 3;
struct Jobs {
  int count;
  int layer[MAX_JOBS];
  int t[MAX_JOBS];
};

// Programmatic dependent launch: a wave lets the next one start its CTAs where SMs are free and
// load its weights (which no wave writes) while this one finishes; the next wave waits for this
// one's completion, and its memory, before it loads anything a wave writes.
__device__ __forceinline__ void allow_next_wave() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait_previous_wave() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The cells at t >= active_steps() are padding. The count is read before griddepcontrol.wait: it
// was written before the stack's first wave, which launches without programmatic serialization.
__device__ __forceinline__ int active_steps(const int* active, int T) {
  if (!active) return T;
  const int n = *active;
  return n < 0 ? 0 : n > T ? T : n;
}
// zeros over `rows` rows of `bytes_per_row` bytes (a multiple of 16), `pitch` bytes apart
__device__ __forceinline__ void zero_rows(void* base, long pitch, int rows, int bytes_per_row) {
  const int per_row = bytes_per_row / 16;
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x)
    *reinterpret_cast<int4*>(static_cast<uint8_t*>(base) + (i / per_row) * pitch +
                             (i % per_row) * 16) = make_int4(0, 0, 0, 0);
}

__device__ __forceinline__ void st_shared_f32(uint32_t a, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t a) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
  return v;
}

// four 8x8 fp16 matrices in the MMA fragment layout (thread: row lane / 4, columns 2 (lane % 4)
// and + 1), stored transposed: lane i gives the address of matrix i / 8's smem row i % 8, which
// receives that matrix's column i % 8
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}
// the same for two matrices (lanes 0-15 give the addresses)
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, const uint32_t (&v)[2]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr),
               "r"(v[0]), "r"(v[1])
               : "memory");
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// the inverse of stmatrix_x4_trans: lane i gives the address of matrix i / 8's smem row i % 8;
// register k of a thread receives matrix k's (row lane / 4, columns 2 (lane % 4), + 1) of the
// transposed rows, i.e. smem rows are the fragment's columns
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&v)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
}
// the same for two matrices (lanes 0-15 give the addresses)
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t addr, uint32_t (&v)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(v[0]), "=r"(v[1])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ float2 unpack_half2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
__device__ __forceinline__ float4 ld_shared_v4(uint32_t a) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(a)
               : "memory");
  return v;
}
// into the same smem offset of cluster CTA `rank`
__device__ __forceinline__ void st_cluster_v4(uint32_t a, uint32_t rank, float4 v) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(r), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}
// publishes this thread's (and, through a preceding barrier, its CTA's) cluster writes
__device__ __forceinline__ void mbar_arrive_remote_release(uint64_t* bar, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("fence.acq_rel.cluster;\n"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(r)
               : "memory");
}
}  // namespace wave


namespace fwd {
using namespace wave;

constexpr int BM = 128, BN = 96, BK = 64;
constexpr int W_SUB = BM * BK * 2, X_SUB = BN * BK * 2, SUB = W_SUB + X_SUB;  // 28 KB
constexpr int C_TILE = BN * 32 * 4;         // the cell state, 96 rows x 32 units, fp32
constexpr int H_TILE = BN * 32 * 2;         // h, dropout(h) or a factor: 96 x 32, fp16
constexpr int N_FACTORS = 6;               // what the backward reads (wave_ref.py)
constexpr int THREADS = 256;
constexpr int MAX_LAYERS = 3;
constexpr int N_TILES = 4 * HID / BM;       // 32 W tiles per layer
constexpr int STAGING = (2 + N_FACTORS) * H_TILE;  // the epilogue's outputs, from ring offset 0
constexpr int XW_BOX = BN * 64 * 2;         // 96 batch rows x 64 gate rows of x W_ih^T, fp16
static_assert(SUB % 1024 == 0 && W_SUB % 1024 == 0, "swizzled tiles need 1024-byte alignment");
static_assert(STAGING <= 2 * SUB, "the epilogue's staging fits in the ring");

constexpr int smem_bytes(int ring) { return ring * SUB + C_TILE + 1024 + 256; }  // + barriers

struct Params {  // 64-byte aligned through CUtensorMap
  CUtensorMap in[MAX_LAYERS];  // [T*B, K_in] fp16, box 64 x 96: the layer's input sequence
  CUtensorMap hl[MAX_LAYERS];  // [(T+1)*B, H] fp16, box 64 x 96: slot 0 = h0, slot t+1 = h(t)
  CUtensorMap w[MAX_LAYERS];   // [4H, K_in + H] fp16, box 64 x 128/C, permuted rows
  CUtensorMap c[MAX_LAYERS];   // [B, H] fp32 cell state, box 32 x 96 (load and store)
  CUtensorMap hs[MAX_LAYERS];  // hseq again, box 32 x 96, 64-byte swizzle (store)
  CUtensorMap ys[MAX_LAYERS];  // [T*B, H] fp16 dropout(h), box 32 x 96 (store)
  CUtensorMap fac[MAX_LAYERS]; // [6, T*B, H] fp16 factors for the backward, box 32 x 96 (store)
  CUtensorMap xw[MAX_LAYERS];  // [T*B, 4H] fp16 x W_ih^T (permuted), box 64 x 96, if has_xw
  CUtensorMap ys_odd;          // pairs: the last layer's odd steps (its ys map: the even ones)
  const float* bias[MAX_LAYERS];  // [4H] permuted
  __half* h_out[MAX_LAYERS];      // hseq and yseq again, for a padded cell's zeros
  __half* y_out[MAX_LAYERS];
  int kin_blocks[MAX_LAYERS];     // 0 where has_xw: the K loop runs over h alone
  int has_xw[MAX_LAYERS];
  int write_factors;              // 0 when no backward follows (scoring): fac is not encoded
  int T, B, L;
  int pairs;                // the last layer's yseq in frame pairs (wave_lstm_forward)
  const int* out_lengths;   // null, or [B]: the last layer's yseq is zero at t >= out_lengths[b]
  Jobs jobs;
  float keep_scale;
  uint32_t drop_threshold;  // 16-bit: drop when a key's half is below it
  const uint32_t* seed;     // on the device: drawn per call, so graph replays draw afresh
  const int* active;        // null, or the active steps on the device (see the top)
};

// HINTS: TMA copies with L2 eviction priorities: W's tiles (read again at every step) last, the
// factor planes (read back only by the backward) and x W_ih^T's tiles first
template <int RING, bool HINTS>
__global__ void __launch_bounds__(THREADS, 1) wave_t(const __grid_constant__ Params p) {
  constexpr int STAGES = RING;
  extern __shared__ uint8_t raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* ctile = ring + RING * SUB;
  uint64_t* full = reinterpret_cast<uint64_t*>(ctile + C_TILE);
  uint64_t* empty = full + STAGES;
  uint64_t* cbar = empty + STAGES;
  uint64_t* xbar = cbar + 1;  // x W_ih^T's tile
  // A layer whose input part was hoisted into one GEMM before the waves has the K loop of h
  // alone; its x W_ih^T tile lands in the ring slot that the stage after the last would take.
  constexpr int XW_OFFSET = ((HID / BK) % STAGES) * SUB;
  static_assert(XW_OFFSET >= STAGING && XW_OFFSET + 2 * XW_BOX <= RING * SUB,
                "x W_ih^T's tile clears the staging and fits in the ring");
  const int nb_count = p.B / BN;
  const int nb = blockIdx.x % nb_count, tile = (blockIdx.x / nb_count) % N_TILES;
  const int job = blockIdx.x / (nb_count * N_TILES);
  const int l = p.jobs.layer[job], t = p.jobs.t[job];
  const int k_blocks = p.kin_blocks[l] + HID / BK;
  const int row0 = nb * BN;  // first batch row
  if (t >= active_steps(p.active, p.T)) {
    // h(t) and dropout(h(t)) are read by the weight gradients' GEMMs (against zero dz rows) and
    // by what follows the stack: zeros, not whatever the memory held. No other cell reads them.
    allow_next_wave();
    const long pitch = HID * 2, col = tile * 32 * 2;
    zero_rows(reinterpret_cast<uint8_t*>(p.h_out[l]) + ((t + 1L) * p.B + row0) * pitch + col,
              pitch, BN, 64);
    if (p.pairs && l == p.L - 1)
      zero_rows(reinterpret_cast<uint8_t*>(p.y_out[l]) +
                    (static_cast<long>(t >> 1) * p.B + row0) * 2 * pitch + (t & 1) * pitch + col,
                2 * pitch, BN, 64);
    else
      zero_rows(reinterpret_cast<uint8_t*>(p.y_out[l]) +
                    (static_cast<long>(t) * p.B + row0) * pitch + col, pitch, BN, 64);
    wait_previous_wave();  // a wave ends after its predecessor: later waves rely on that order
    return;
  }
  const int warp_group = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);
    }
    mbar_init(cbar, 1);
    mbar_init(xbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  allow_next_wave();

  if (warp_group == 0) {
    if (tid == 0) {
      uint64_t keep = 0, once = 0;
      if constexpr (HINTS) {
        keep = l2_evict_last();
        once = l2_evict_first();
      }
      auto load_w = [&](int kb) {
        tma_load<HINTS>(ring + (kb % STAGES) * SUB, &p.w[l], &full[kb % STAGES], kb * BK,
                        tile * BM, keep);
      };
      const int early = k_blocks < STAGES ? k_blocks : STAGES;
      for (int kb = 0; kb < early; ++kb) {
        mbar_expect_tx(&full[kb], SUB);
        load_w(kb);
      }
      wait_previous_wave();
      mbar_expect_tx(cbar, C_TILE);
      tma_load_2d(ctile, &p.c[l], cbar, tile * 32, row0);
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % STAGES;
        if (kb >= early) {
          mbar_wait(&empty[s], ((kb / STAGES) & 1) ^ 1);
          mbar_expect_tx(&full[s], SUB);
          load_w(kb);
        }
        const bool from_in = kb < p.kin_blocks[l];
        tma_load_2d(ring + s * SUB + W_SUB, from_in ? &p.in[l] : &p.hl[l], &full[s],
                    (from_in ? kb : kb - p.kin_blocks[l]) * BK, t * p.B + row0);
      }
      if (p.has_xw[l]) {
        const int kb = k_blocks;
        mbar_wait(&empty[kb % STAGES], ((kb / STAGES) & 1) ^ 1);
        mbar_expect_tx(xbar, 2 * XW_BOX);
        for (int half = 0; half < 2; ++half)
          tma_load<HINTS>(ring + XW_OFFSET + half * XW_BOX, &p.xw[l], xbar,
                          tile * BM + 64 * half, t * p.B + row0, once);
      }
    }
  } else {
    wait_previous_wave();
    const int warp = tid / 32, lane = tid % 32, q = lane & 3, r = lane >> 2;
    const int unit_local = 8 * warp + r;
    float bias[4];
#pragma unroll
    for (int g = 0; g < 4; ++g)
      bias[g] = p.bias[l][tile * BM + 64 * (g >> 1) + 16 * warp + 8 * (g & 1) + r];
    float d[2][48];
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(&full[s], (kb / STAGES) & 1);
      // no zero-initialized accumulators (scale-d = 0 on the first MMA instead): ptxas would
      // serialize every wgmma (C7515)
      wgmma_fence();
      fence_acc(d[0]);
      fence_acc(d[1]);
      {
        const uint32_t wa = smem_u32(ring + s * SUB), xa = wa + W_SUB;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            mma_64x96(d[half], wa + half * 64 * 128 + kk * 32, xa + kk * 32,
                               (kb | kk) != 0);
      }
      wgmma_commit();
      fence_acc(d[0]);
      fence_acc(d[1]);
      wgmma_wait<1>();
      fence_acc(d[0]);
      fence_acc(d[1]);
      if (kb >= 1 && lane == 0) mbar_arrive(&empty[(kb - 1) % STAGES]);
    }
    wgmma_wait<0>();
    fence_acc(d[0]);
    fence_acc(d[1]);
    if (lane == 0) mbar_arrive(&empty[(k_blocks - 1) % STAGES]);  // the last stage too
    mbar_wait(cbar, 0);
    {
      // The ring is free for staging once every MMA is done: the producer issues exactly k_blocks
      // stages and every one of them has landed.
      // Staging: h, dropout(h), then the six factor planes, each 96 batch rows x 32 units.
      const uint32_t st = smem_u32(ring), ct = smem_u32(ctile);
      const int unit = tile * 32 + unit_local;
      const uint32_t step = step_seed(*p.seed, l, t);
      const int mi = lane >> 3, c8 = lane & 7;  // the matrix and the smem row this lane addresses
      const bool has_xw = p.has_xw[l];
      // bit 2 jj + i: batch row 8 jj + 2 q + i of the tile is inside its sequence at step t
      uint32_t live = ~0u;
      if (p.out_lengths != nullptr && l == p.L - 1) {
        live = 0;
#pragma unroll
        for (int jj = 0; jj < 12; ++jj)
#pragma unroll
          for (int i = 0; i < 2; ++i)
            live |= static_cast<uint32_t>(t < p.out_lengths[row0 + 8 * jj + 2 * q + i])
                    << (2 * jj + i);
      }
      if (has_xw) mbar_wait(xbar, 0);
#pragma unroll
      for (int pj = 0; pj < 3; ++pj) {
        // batch blocks jj = 4 pj .. 4 pj + 3; out[k][m]: tile k's fragment of block 4 pj + m
        // (row: this thread's unit, columns: batch rows 8 jj + 2q, + 1)
        uint32_t out[2 + N_FACTORS][4];
        // x W_ih^T in the same fragments: xv[half][pair][2 (m % 2) + i] holds gate 2 half + i of
        // batch block 4 pj + 2 pair + m % 2 (the backward reads its factor tiles this way)
        uint32_t xv[2][2][4] = {};
        if (has_xw) {
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int pair = 0; pair < 2; ++pair)
              ldmatrix_x4_trans(st + XW_OFFSET + half * XW_BOX +
                                    swz128((8 * (4 * pj + 2 * pair + (mi >> 1)) + c8) * 128 +
                                           (16 * warp + 8 * (mi & 1)) * 2),
                                xv[half][pair]);
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int jj = 4 * pj + m;
          float v[2 + N_FACTORS][2];
          const uint32_t key = drop_key(step, row0 + 8 * jj + 2 * q, unit);
#pragma unroll
          for (int bit = 0; bit < 2; ++bit) {
            const int b = 8 * jj + 2 * q + bit;  // batch row inside the tile
            const int k = 4 * jj + bit;
            float x[2][2];
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                const float2 xf = unpack_half2(xv[half][m >> 1][2 * (m & 1) + i]);
                x[half][i] = bit ? xf.y : xf.x;
              }
            const float gi = sigmoid_fast(d[0][k] + bias[0] + x[0][0]);
            const float gf = sigmoid_fast(d[0][k + 2] + bias[1] + x[0][1]);
            const float gg = tanh_fast(d[1][k] + bias[2] + x[1][0]);
            const float go = sigmoid_fast(d[1][k + 2] + bias[3] + x[1][1]);
            const uint32_t ca = ct + swz128(b * 128 + unit_local * 4);
            const float cp = ld_shared_f32(ca);
            const float c = fmaf(gf, cp, gi * gg);
            st_shared_f32(ca, c);
            const float tc = tanh_fast(c);
            const float h = __half2float(__float2half_rn(go * tc));
            v[0][bit] = h;
            v[1][bit] = dropped(key, bit, p.drop_threshold) || !((live >> (2 * jj + bit)) & 1)
                            ? 0.f
                            : h * p.keep_scale;
            // the backward's factors (see wave_ref.py)
            v[2][bit] = go * (1.f - tc * tc);
            v[3][bit] = gg * gi * (1.f - gi);
            v[4][bit] = cp * gf * (1.f - gf);
            v[5][bit] = gi * (1.f - gg * gg);
            v[6][bit] = tc * go * (1.f - go);
            v[7][bit] = gf;
          }
#pragma unroll
          for (int f = 0; f < 2 + N_FACTORS; ++f) out[f][m] = pack_half2(v[f][0], v[f][1]);
        }
        // matrix mi of each stmatrix: batch block 4 pj + mi, this warp's 8 units (16 bytes of a
        // 64-byte row)
        const uint32_t o = swz64((8 * (4 * pj + mi) + c8) * 64 + 16 * warp);
#pragma unroll
        for (int f = 0; f < 2 + N_FACTORS; ++f) stmatrix_x4_trans(st + f * H_TILE + o, out[f]);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync 1, 128;" ::: "memory");
      if (tid == 0) {
        const int rows = p.T * p.B;
        tma_store_2d(&p.c[l], ctile, tile * 32, row0);
        tma_store_2d(&p.hs[l], ring, tile * 32, (t + 1) * p.B + row0);
        if (p.pairs && l == p.L - 1)
          tma_store_2d(t & 1 ? &p.ys_odd : &p.ys[l], ring + H_TILE, tile * 32,
                       (t >> 1) * p.B + row0);
        else
          tma_store_2d(&p.ys[l], ring + H_TILE, tile * 32, t * p.B + row0);
        uint64_t once = 0;
        if constexpr (HINTS) once = l2_evict_first();
        if (p.write_factors) {
#pragma unroll
          for (int f = 0; f < N_FACTORS; ++f)
            tma_store<HINTS>(&p.fac[l], ring + (2 + f) * H_TILE, tile * 32,
                             f * rows + t * p.B + row0, once);
        }
        bulk_commit();
        bulk_wait_read();
      }
    }
  }
}


}  // namespace fwd


namespace bwd {
using namespace wave;

constexpr int BM = 64, BN = 96, BK = 64;
constexpr int A_SUB = BM * BK * 2, B_SUB = BN * BK * 2, SUB = A_SUB + B_SUB;  // 20 KB
constexpr int F_TILE = BN * 64 * 2;   // 96 batch rows x 64 units fp16 (factor, dY, dz quarter)
constexpr int DC_BOX = BN * 32 * 4;   // 96 x 32 fp32: dc is two boxes
constexpr int PART = 48 * 128 * 4;    // the partner's accumulators, after the ring
// The epilogue's inputs (factors A1..A5, A6(t + 1), dY, dc as 2 boxes) land in the ring slots that
// the last K stages free, so that the ring can be deep: with a separate region it held 4 stages.
constexpr int E_FNEXT = 5 * F_TILE, E_DY = 6 * F_TILE, E_DC = 7 * F_TILE;
constexpr int E_IN = E_DC + 2 * DC_BOX;  // 108 KB
constexpr int E_TILES = E_IN / F_TILE;   // 9 tiles of 12 KB
constexpr int STAGING = 4 * F_TILE;      // dz(t), staged for its TMA store
constexpr int THREADS = 256;
constexpr int MAX_LAYERS = 3;
constexpr int U_TILES = HID / BM;  // 16
static_assert(SUB % 1024 == 0 && F_TILE % 1024 == 0 && DC_BOX % 1024 == 0, "1024-byte tiles");
static_assert(DC_BOX == F_TILE, "the epilogue's inputs are 12 KB tiles");

// Where the epilogue's inputs and dz's staging sit in a ring of `ring` 64-wide stages when the K
// loop has k_blocks stages: the inputs from the slot that stage k_blocks would take (the first
// freed), the staging in what stays free; -1 when that layout does not fit without wrapping.
__host__ __device__ constexpr int epilogue_offset(int ring, int k_blocks) {
  return (k_blocks % ring) * SUB + E_IN <= ring * SUB ? (k_blocks % ring) * SUB : -1;
}
__host__ __device__ constexpr int staging_offset(int ring, int k_blocks) {
  return epilogue_offset(ring, k_blocks) < 0 ? -1
         : epilogue_offset(ring, k_blocks) >= STAGING ? 0
         : epilogue_offset(ring, k_blocks) + E_IN + STAGING <= ring * SUB
             ? epilogue_offset(ring, k_blocks) + E_IN
             : -1;
}
__host__ __device__ constexpr bool ring_fits(int ring) {
  return staging_offset(ring, 0) >= 0 && staging_offset(ring, 4 * HID / BK) >= 0;
}
// the accumulators a consumer thread hands to its producer twin, d[4 j + 2] and d[4 j + 3] for the
// 12 batch blocks j, after the barriers
constexpr int HANDOFF_BYTES = 24 * 128 * 4;
__host__ __device__ constexpr int smem_bytes(int ring) {
  return ring * SUB + PART + 1024 + 256 + HANDOFF_BYTES;
}

struct Params {  // 64-byte aligned through CUtensorMap
  CUtensorMap wt[MAX_LAYERS];   // [kin + H, 4H] fp16 W^T, permuted gate columns, box 64 x 64
  CUtensorMap dz[MAX_LAYERS];   // [T*B, 4H] fp16, box 64 x 96 (the B operand, and stores)
  CUtensorMap fac[MAX_LAYERS];  // [6, T*B, H] fp16, box 64 x 96
  CUtensorMap dc[MAX_LAYERS];   // [B, H] fp32 running dc, box 32 x 96
  CUtensorMap dy;               // [T*B, H] fp16: the top layer's output gradient, box 64 x 96
  CUtensorMap dy_odd;           // pairs: its odd steps (dy: the even ones)
  float* dbias[MAX_LAYERS];     // [T * B / 96, 4H]: dz summed over each 96-row batch tile
  __half* dz_out[MAX_LAYERS];   // dz again, for a padded cell's zeros
  int kin[MAX_LAYERS];
  int T, B, L;
  int pairs;                // dy in frame pairs, as the forward's yseq
  const int* dy_lengths;    // null, or [B]: dy is taken as zero at t >= dy_lengths[b]
  Jobs jobs;
  float keep_scale;
  uint32_t drop_threshold;  // 16-bit, as the forward's
  const uint32_t* seed;     // the forward's
  const int* active;        // the forward's
};

// The epilogue of a main CTA's tile for accumulator row I of each thread (units 16 warp + 8 I + r
// of the tile): dh from d (this thread's accumulator fragments, or the same values handed over)
// and the partner's partials or dy, dc through the dc tile, dz staged at `staging` for its TMA
// store, and the bias gradient's partial sums of those units. The consumer's warp group runs
// I = 0, the producer's I = 1. The epilogue's inputs are at e.
template <int I>
__device__ __forceinline__ void cells(const Params& p, const float (&d)[48], int tid, uint32_t e,
                                      uint32_t part, uint32_t staging, int l, int t, int ut, int nb,
                                      int row0, bool top, bool last_step) {
  const int warp = tid / 32, lane = tid % 32, q = lane & 3, r = lane >> 2;
  const int nb_count = p.B / BN;
  const uint32_t step = step_seed(*p.seed, l, t);
  const int c8 = lane & 7;
  const int ul = 16 * warp + 8 * I + r;  // this thread's unit inside the tile
  float dbias[4] = {};  // [gate]: this thread's rows of dz (as stored, fp16) summed
  // bit 2 j + i: batch row 8 j + 2 q + i of the tile is inside its sequence at step t
  uint32_t live = ~0u;
  if (top && p.dy_lengths != nullptr) {
    live = 0;
#pragma unroll
    for (int j = 0; j < 12; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        live |= static_cast<uint32_t>(t < p.dy_lengths[row0 + 8 * j + 2 * q + i]) << (2 * j + i);
  }
#pragma unroll
  for (int pj = 0; pj < 6; ++pj) {
    // ldmatrix / stmatrix: lanes 0-15 address matrix mj = lane / 8 % 2, batch block 2 pj + mj
    const int j_l = 2 * pj + ((lane >> 3) & 1);
    const uint32_t frag = swz128((8 * j_l + c8) * 128 + (16 * warp + 8 * I) * 2);
    uint32_t fv[7][2];
#pragma unroll
    for (int f = 0; f < 7; ++f) {
      if ((f == 5 && last_step) || (f == 6 && !top)) continue;
      ldmatrix_x2_trans(e + (f < 5 ? f * F_TILE : f == 5 ? E_FNEXT : E_DY) + frag, fv[f]);
    }
    uint32_t dzv[4][2];  // [gate][matrix]
#pragma unroll
    for (int mj = 0; mj < 2; ++mj) {
      const int j = 2 * pj + mj;
      const uint32_t key = drop_key(step, row0 + 8 * j + 2 * q, ut * BM + ul);
      float4 pv = make_float4(0.f, 0.f, 0.f, 0.f);
      float dzf[4][2];
#pragma unroll
      for (int bit = 0; bit < 2; ++bit) {
        const int k = 4 * j + 2 * I + bit, b = 8 * j + 2 * q + bit;
        float dy;
        if (top) {
          const float2 v = unpack_half2(fv[6][mj]);
          dy = (live >> (2 * j + bit)) & 1 ? (bit ? v.y : v.x) : 0.f;
        } else {
          if (bit == 0) pv = ld_shared_v4(part + ((k >> 2) * 128 + tid) * 16);
          const float* pf = &pv.x;
          dy = pf[k & 3];
        }
        const float dh = d[k] + (dropped(key, bit, p.drop_threshold) ? 0.f : dy * p.keep_scale);
        float a[5];
#pragma unroll
        for (int f = 0; f < 5; ++f) {
          const float2 v = unpack_half2(fv[f][mj]);
          a[f] = bit ? v.y : v.x;
        }
        const uint32_t ca = e + E_DC + (ul >> 5) * DC_BOX + swz128(b * 128 + (ul & 31) * 4);
        float dc = dh * a[0];
        if (!last_step) {
          const float2 v = unpack_half2(fv[5][mj]);
          dc = fmaf(bit ? v.y : v.x, ld_shared_f32(ca), dc);
        }
        st_shared_f32(ca, dc);
        dzf[0][bit] = dc * a[1];
        dzf[1][bit] = dc * a[2];
        dzf[2][bit] = dc * a[3];
        dzf[3][bit] = dh * a[4];
      }
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        dzv[g][mj] = pack_half2(dzf[g][0], dzf[g][1]);
        const float2 stored = unpack_half2(dzv[g][mj]);
        dbias[g] += stored.x + stored.y;
      }
    }
    // dz of unit ul, gate g goes to the forward's permuted column: quarter 2 (ul / 32) +
    // g / 2 of the tile's 256 columns, column 16 ((ul % 32) / 8) + 8 (g % 2) + ul % 8
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int quarter = 2 * (warp >> 1) + (g >> 1);
      const int col = 16 * ((2 * warp + I) & 3) + 8 * (g & 1);
      stmatrix_x2_trans(staging + quarter * F_TILE + swz128((8 * j_l + c8) * 128 + col * 2),
                        dzv[g]);
    }
  }
  // the bias gradient's partial sums (a deterministic order, unlike atomics): the four lanes of a
  // unit hold its 96 batch rows; columns as dz's
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    float v = dbias[g];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (q == 0) {
      const int col = ut * 4 * BM + 64 * (2 * (warp >> 1) + (g >> 1)) +
                      16 * ((2 * warp + I) & 3) + 8 * (g & 1) + r;
      p.dbias[l][static_cast<long>(t * nb_count + nb) * 4 * HID + col] = v;
    }
  }
}

// HINTS: as the forward's; here W^T's tiles last, the forward's factor planes and dy first. In a
// main CTA both warp groups run the epilogue: the producer's, idle once its loads are issued,
// takes accumulator rows i = 1 from the consumer through shared memory, the consumer keeps i = 0,
// so that each warp scheduler has two warps of epilogue arithmetic where it had one.
template <int RING, bool HINTS>
__global__ void __launch_bounds__(THREADS, 1) wave_bwd(const __grid_constant__ Params p) {
  constexpr int STAGES = RING;
  static_assert(ring_fits(RING), "the epilogue's inputs and staging fit in the ring");
  static_assert(smem_bytes(RING) <= 227 * 1024, "shared memory");
  extern __shared__ uint8_t raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* part_area = ring + RING * SUB;
  uint64_t* full = reinterpret_cast<uint64_t*>(part_area + PART);
  uint64_t* empty = full + STAGES;
  uint64_t* ebar = empty + STAGES;  // the epilogue's TMA inputs
  uint64_t* pbar = ebar + 1;        // the partner's accumulators
  // the consumer's accumulators for the producer's epilogue, past the barriers' 256 bytes
  const uint32_t hand = smem_u32(part_area) + PART + 256;

  // which (layer, unit tile, batch tile, role) this CTA is
  const int nb_count = p.B / BN;
  // the top layer's clusters pair two batch tiles; below it, a main CTA and its partner
  int cid = blockIdx.x / 2, job = 0;
  const int rank = blockIdx.x % 2;
  for (; job + 1 < p.jobs.count; ++job) {
    const int clusters = U_TILES * nb_count / (p.jobs.layer[job] == p.L - 1 ? 2 : 1);
    if (cid < clusters) break;
    cid -= clusters;
  }
  const int l = p.jobs.layer[job], t = p.jobs.t[job];
  int ut, nb;
  bool partner;
  if (l == p.L - 1) {
    ut = cid / (nb_count / 2);
    nb = (cid % (nb_count / 2)) * 2 + rank;
    partner = false;
  } else {
    ut = cid / nb_count;
    nb = cid % nb_count;
    partner = rank == 1;
  }
  const int row0 = nb * BN;
  const int steps = active_steps(p.active, p.T);
  if (t >= steps) {
    // dz(t) rows enter the weight and input gradients' GEMMs, the partial sums the bias
    // gradient: zeros. The partner has nothing to write, and no CTA of the cluster touches the
    // other's shared memory, so neither waits for the other.
    allow_next_wave();
    if (!partner) {
      zero_rows(reinterpret_cast<uint8_t*>(p.dz_out[l]) +
                    ((static_cast<long>(t) * p.B + row0) * 4 * HID + ut * 4 * BM) * 2,
                4 * HID * 2, BN, 4 * BM * 2);
      zero_rows(p.dbias[l] + static_cast<long>(t * nb_count + nb) * 4 * HID + ut * 4 * BM, 0, 1,
                4 * BM * 4);
    }
    wait_previous_wave();  // a wave ends after its predecessor: later waves rely on that order
    return;
  }
  const bool top = l == p.L - 1, last_step = t == steps - 1;
  // the main CTA's K: dz_l(t + 1) x W_hh,l (none at t = T - 1); the partner's: dz_{l+1}(t) x W_ih,{l+1}
  const int k_blocks = (partner || !last_step) ? 4 * HID / BK : 0;
  uint8_t* const epi = ring + epilogue_offset(RING, k_blocks);
  uint8_t* const staging = ring + staging_offset(RING, k_blocks);
  const int src = partner ? l + 1 : l;
  const int a_row = partner ? ut * BM : p.kin[l] + ut * BM;
  const int b_row = (partner ? t : t + 1) * p.B + row0;

  const int warp_group = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);
    }
    mbar_init(ebar, 1);
    mbar_init(pbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  allow_next_wave();

  if (warp_group == 0) {
    if (tid == 0) {
      uint64_t keep = 0, once = 0;
      if constexpr (HINTS) {
        keep = l2_evict_last();
        once = l2_evict_first();
      }
      const int early = k_blocks < STAGES ? k_blocks : STAGES;
      for (int kb = 0; kb < early; ++kb) {
        mbar_expect_tx(&full[kb], SUB);
        tma_load<HINTS>(ring + kb * SUB, &p.wt[src], &full[kb], kb * BK, a_row, keep);
      }
      wait_previous_wave();
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % STAGES;
        if (kb >= early) {
          mbar_wait(&empty[s], ((kb / STAGES) & 1) ^ 1);
          mbar_expect_tx(&full[s], SUB);
          tma_load<HINTS>(ring + s * SUB, &p.wt[src], &full[s], kb * BK, a_row, keep);
        }
        tma_load_2d(ring + s * SUB + A_SUB, &p.dz[src], &full[s], kb * BK, b_row);
      }
      if (!partner) {
        // each input tile as soon as the slots under it are free: slot k_blocks % RING + v is
        // "stage" k_blocks + v, freed when stage k_blocks + v - RING has been consumed
        const int rows = p.T * p.B;
        uint32_t bytes = 5 * F_TILE + 2 * DC_BOX + (last_step ? 0 : F_TILE) + (top ? F_TILE : 0);
        mbar_expect_tx(ebar, bytes);
        int freed = 0;  // slots of the input region known to be free
        for (int tile = 0; tile < E_TILES; ++tile) {
          for (; freed * SUB < (tile + 1) * F_TILE; ++freed) {
            const int kb = k_blocks + freed;
            mbar_wait(&empty[kb % STAGES], ((kb / STAGES) & 1) ^ 1);
          }
          uint8_t* dst = epi + tile * F_TILE;
          if (tile < 5)
            tma_load<HINTS>(dst, &p.fac[l], ebar, ut * BM, tile * rows + t * p.B + row0, once);
          else if (tile == 5 && !last_step)
            tma_load<HINTS>(dst, &p.fac[l], ebar, ut * BM, 5 * rows + (t + 1) * p.B + row0,
                            once);
          else if (tile == 6 && top)
            tma_load<HINTS>(dst, p.pairs && (t & 1) ? &p.dy_odd : &p.dy, ebar, ut * BM,
                            (p.pairs ? t >> 1 : t) * p.B + row0, once);
          else if (tile >= 7)
            tma_load_2d(dst, &p.dc[l], ebar, ut * BM + 32 * (tile - 7), row0);
        }
      }
    }
    if (!partner) {
      __syncwarp();  // thread 0 ran the loads alone: the warp's .aligned instructions need it back
      float d[48];  // only the handed-over entries, d[4 j + 2] and d[4 j + 3], are set and read
      asm volatile("bar.sync 2, 256;" ::: "memory");  // the consumer's bar.arrive: d is there
#pragma unroll
      for (int j = 0; j < 12; ++j)
#pragma unroll
        for (int bit = 0; bit < 2; ++bit)
          d[4 * j + 2 + bit] = ld_shared_f32(hand + ((2 * j + bit) * 128 + tid) * 4);
      mbar_wait(ebar, 0);
      if (!top) mbar_wait<true>(pbar, 0);
      cells<1>(p, d, tid, smem_u32(epi), smem_u32(part_area), smem_u32(staging), l, t, ut, nb,
                  row0, top, last_step);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync 1, 256;" ::: "memory");  // the consumer stores both halves
    }
  } else {
    wait_previous_wave();
    const int lane = tid % 32;
    float d[48];
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(&full[s], (kb / STAGES) & 1);
      wgmma_fence();
      fence_acc(d);
      {
        const uint32_t a = smem_u32(ring + s * SUB), b = a + A_SUB;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          mma_64x96(d, a + kk * 32, b + kk * 32, (kb | kk) != 0);
      }
      wgmma_commit();
      fence_acc(d);
      wgmma_wait<1>();
      fence_acc(d);
      if (kb >= 1 && lane == 0) mbar_arrive(&empty[(kb - 1) % STAGES]);
    }
    wgmma_wait<0>();
    fence_acc(d);
    // the last stage's slot too: the producer may be waiting to put an epilogue input there
    if (k_blocks > 0 && lane == 0) mbar_arrive(&empty[(k_blocks - 1) % STAGES]);
    if (k_blocks == 0) {
#pragma unroll
      for (int k = 0; k < 48; ++k) d[k] = 0.f;
    }
    if (!partner) {
#pragma unroll
      for (int j = 0; j < 12; ++j)
#pragma unroll
        for (int bit = 0; bit < 2; ++bit)
          st_shared_f32(hand + ((2 * j + bit) * 128 + tid) * 4, d[4 * j + 2 + bit]);
      asm volatile("bar.arrive 2, 256;" ::: "memory");
    }
    if (partner) {
      {
        // thread tid's accumulators, 4 at a time, into the main CTA's partner area
        const uint32_t part = smem_u32(part_area);
#pragma unroll
        for (int k4 = 0; k4 < 12; ++k4)
          st_cluster_v4(part + (k4 * 128 + tid) * 16, 0,
                        make_float4(d[4 * k4], d[4 * k4 + 1], d[4 * k4 + 2], d[4 * k4 + 3]));
        asm volatile("bar.sync 1, 128;" ::: "memory");
        if (tid == 0) mbar_arrive_remote_release(pbar, 0);
      }
    } else {
      mbar_wait(ebar, 0);
      {
        if (!top) mbar_wait<true>(pbar, 0);
        cells<0>(p, d, tid, smem_u32(epi), smem_u32(part_area), smem_u32(staging), l, t, ut, nb,
                 row0, top, last_step);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("bar.sync 1, 256;" ::: "memory");  // the producer's rows are staged too
        if (tid == 0) {
          for (int qt = 0; qt < 4; ++qt)
            tma_store_2d(&p.dz[l], staging + qt * F_TILE, ut * 4 * BM + 64 * qt, t * p.B + row0);
          for (int i = 0; i < 2; ++i)
            tma_store_2d(&p.dc[l], epi + E_DC + i * DC_BOX, ut * BM + 32 * i, row0);
          bulk_commit();
          bulk_wait_read();
        }
      }
    }
  }
  // The producer thread's 31 warp-mates skipped its loop: a `.aligned` barrier needs the
  // whole warp there together.
  __syncwarp();
  cluster_sync();  // no CTA leaves while its partner may still write into it
}


}  // namespace bwd

// ------------------------------------------------------------------------------------------------
// Host side: one call queues every wave of a stack's forward or backward on `stream`.

namespace {
using namespace wave;

constexpr int kBadShape = 1, kBadVariant = 2, kNoEncoder = 3, kEncodeFailed = 1000;
constexpr int kMaxDevices = 64;

// Variant 2 of each is what lstm_wave.py runs: programmatic dependent launch, and L2 eviction
// priorities on its TMA copies (HINTS) that keep the weights, which every wave step streams,
// ahead of the factor planes written and read once. Variant 1 is it without the priorities
// (1-2% slower a stack, docs/PERFORMANCE.md), variant 0 launches every wave after the previous
// one ends (no programmatic dependent launch): the A/B references of bench/encoder_lstm.py.
// Measured and dropped (docs/PERFORMANCE.md): 128-wide forward stages, clusters of two
// multicasting W's tile, backward rings 9 or 10 deep, each MMA split on the batch rows' halves
// (two accumulation chains instead of one: slower), the forward's epilogue on both warp groups
// (no gain, unlike the backward's), and ready counters per cell in place of the wait for the
// whole previous wave (about 1 ms a step slower in the forward, no gain in the backward).
struct FwdVariant { void (*kernel)(fwd::Params); int ring; bool pdl; };
const FwdVariant kFwdVariants[] = {
    {fwd::wave_t<7, false>, 7, false},
    {fwd::wave_t<7, false>, 7, true},
    {fwd::wave_t<7, true>, 7, true},
};
struct BwdVariant { void (*kernel)(bwd::Params); int ring; bool pdl; };
const BwdVariant kBwdVariants[] = {
    {bwd::wave_bwd<8, false>, 8, false},
    {bwd::wave_bwd<8, false>, 8, true},
    {bwd::wave_bwd<8, true>, 8, true},
};
constexpr int kFwdCount = sizeof(kFwdVariants) / sizeof(kFwdVariants[0]);
constexpr int kBwdCount = sizeof(kBwdVariants) / sizeof(kBwdVariants[0]);

int encode_checked(CUtensorMap* map, const void* ptr, long rows, long cols, bool fp32,
                   int box_cols, int box_rows, CUtensorMapSwizzle swizzle, long pitch = 0) {
  if (!encoder()) return kNoEncoder;
  const CUresult r = encode_2d(map, ptr, rows, cols, fp32, box_cols, box_rows, swizzle, pitch);
  return r == CUDA_SUCCESS ? 0 : kEncodeFailed + static_cast<int>(r);
}

// the large dynamic shared memory is opted into once per device and kernel
template <typename Kernel>
int allow_smem(int device, Kernel kernel, int bytes, bool (&done)[kMaxDevices]) {
  if (done[device]) return 0;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  done[device] = true;
  return 0;
}

// The device's highest launch priority. A wave is a barrier for the whole recurrence: one CTA
// that waits for an SM delays every later step. So when other work runs beside the waves on
// another stream (the training graphs run the prediction network so), the CTA scheduler should
// give each freed SM to the next wave first; the kernels beside them get what the waves leave.
// The priority is a launch attribute, so CUDA graphs keep it in the kernel node.
int highest_priority(int& priority) {
  int least = 0, greatest = 0;
  const cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  priority = greatest;
  return static_cast<int>(err);
}

// `programmatic`: may start before the previous kernel on the stream ends (it waits for it
// inside); only for a stack's later waves, whose previous kernel is a wave of the same call
template <typename P>
int launch(void (*kernel)(P), const P& p, int ctas, int cluster, int smem, bool programmatic,
           cudaStream_t stream) {
  static int priority = 0;
  static const int priority_err = highest_priority(priority);
  if (priority_err) return priority_err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributePriority;
  attr[1].val.priority = priority;
  attr[2].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[2].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 3 : 2;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Makes `device` current only when it is not: these calls are captured into CUDA graphs, and
// changing the device is no business of a capture.
int use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  return static_cast<int>(err);
}

// The launches of a stack, in order, as cells (stage s, step u): the forward's stage is the layer
// and u = t; the backward's stage is L - 1 - layer and u = T - 1 - t. Cell (s, u) needs (s, u - 1)
// and (s - 1, u) from earlier launches. A launch takes the ready cells, deepest stage first, while
// their CTAs fit in `budget` (at least one cell), so a 3-layer stack whose cells take 64 CTAs each
// runs two cells per launch on 132 SMs (369 launches for T = 245) rather than three in two rounds.
template <typename Emit>
int wave_schedule(int stages, int T, const int* ctas, int budget, Emit&& emit) {
  int next[MAX_JOBS] = {0, 0, 0};
  int launches = 0;
  while (next[stages - 1] < T) {
    const int before[MAX_JOBS] = {next[0], next[1], next[2]};
    Jobs cells = {};
    int used = 0;
    for (int s = stages - 1; s >= 0; --s) {
      const bool ready = before[s] < T && (s == 0 || before[s - 1] > before[s]);
      if (!ready || (cells.count > 0 && used + ctas[s] > budget)) continue;
      cells.layer[cells.count] = s;
      cells.t[cells.count] = before[s];
      ++cells.count;
      used += ctas[s];
      ++next[s];
    }
    const int r = emit(cells);
    if (r) return -r;
    ++launches;
  }
  return launches;
}

// the cells' CTAs per stage, and the (layer, t) of a cell
void stage_ctas(bool backward, int layers, int B, int (&ctas)[MAX_JOBS]) {
  for (int s = 0; s < layers; ++s)
    ctas[s] = backward ? bwd::U_TILES * (B / bwd::BN) * (s == 0 ? 1 : 2)
                       : fwd::N_TILES * (B / fwd::BN);
}
Jobs cells_to_jobs(bool backward, int layers, int T, const Jobs& cells) {
  Jobs jobs = cells;
  if (backward)
    for (int j = 0; j < cells.count; ++j) {
      jobs.layer[j] = layers - 1 - cells.layer[j];
      jobs.t[j] = T - 1 - cells.t[j];
    }
  return jobs;
}

int sm_count(int device) {
  static int count[kMaxDevices] = {};
  if (!count[device] &&
      cudaDeviceGetAttribute(&count[device], cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return count[device];
}

uint32_t drop_threshold(float p_drop) {
  return static_cast<uint32_t>(static_cast<double>(p_drop) * 65536.0 + 0.5);
}

}  // namespace

extern "C" {

// The forward of an L-layer stack (L <= 3, hidden 1024), T steps, batch B (a multiple of 96).
// Per layer l, all contiguous fp16 unless said:
//   x_in[l]   [T*B, kin[l]]: the layer's input (l > 0: yseq[l - 1]); kin[l] % 64 == 0
//   xw[l]     null, or [T*B, 4H] fp16: x_in W_ih^T (rows permuted as w's) from one GEMM before
//             the waves; then kin[l] = 0, x_in[l] is not read and w[l] is [4H, H] (W_hh alone)
//   hseq[l]   [(T+1)*B, H]: slot 0 = h0 (the caller zeroes it), slot t + 1 = h(t)
//   yseq[l]   [T*B, H]: dropout(h); the last layer's is the stack's output
//   cstate[l] [B, H] fp32: c0 in (the caller zeroes it), c(T - 1) out
//   factors[l][6, T*B, H]: what the backward reads; factors null: none written (scoring)
//   bias[l]   [4H] fp32, w[l] [4H, kin[l] + H]: b_ih + b_hh and [W_ih | W_hh], rows permuted
//             (rnnt/kernels/lstm_wave.py: gate_permutation)
// seed: one uint32 on the device. active: null, or one int32 on the device, n: the steps t >= n
// are padding (their h and yseq rows come out zero; cstate ends at c(n - 1); their factors are not
// written). out_lengths: null, or int32 [B] on the device: the last layer's yseq is zero at
// t >= out_lengths[b] (each row's padding). pairs: yseq[L - 1] is [ceil(T / 2) * B, 2H] instead,
// steps 2u and 2u + 1 of row b side by side in row u B + b (the encoder's stacking of two frames;
// for odd T the caller zeroes the last row block's odd half, which no step writes). Returns 0 or
// a code that wave_lstm_error describes.
int wave_lstm_forward(int device, int layers, int T, int B, const int* kin, void* const* x_in,
                      void* const* xw, void* const* hseq, void* const* yseq, void* const* cstate,
                      void* const* factors, void* const* bias, void* const* w, float p_drop,
                      const void* seed, const void* active, const void* out_lengths, int pairs,
                      int variant, void* stream) {
  if (variant < 0 || variant >= kFwdCount) return kBadVariant;
  const FwdVariant& v = kFwdVariants[variant];
  if (layers < 1 || layers > fwd::MAX_LAYERS || T < 1 || B < fwd::BN || B % fwd::BN ||
      !(p_drop >= 0.f && p_drop < 1.f))
    return kBadShape;
  for (int l = 0; l < layers; ++l)
    if (xw[l] ? kin[l] != 0 : kin[l] < fwd::BK || kin[l] % fwd::BK)
      return kBadShape;
  if (device < 0 || device >= kMaxDevices) return kBadShape;
  const int err = use_device(device);
  if (err) return err;
  fwd::Params p = {};
  const auto SW128 = CU_TENSOR_MAP_SWIZZLE_128B, SW64 = CU_TENSOR_MAP_SWIZZLE_64B;
  const long rows = static_cast<long>(T) * B, rows1 = rows + B;
  const long pair_rows = static_cast<long>((T + 1) / 2) * B;
  for (int l = 0; l < layers; ++l) {
    int r = xw[l] ? encode_checked(&p.xw[l], xw[l], rows, 4 * HID, false, 64, fwd::BN, SW128)
                  : encode_checked(&p.in[l], x_in[l], rows, kin[l], false, fwd::BK, fwd::BN, SW128);
    if (!r) r = encode_checked(&p.hl[l], hseq[l], rows1, HID, false, fwd::BK, fwd::BN, SW128);
    if (!r)
      r = encode_checked(&p.w[l], w[l], 4 * HID, kin[l] + HID, false, fwd::BK,
                         fwd::BM, SW128);
    if (!r) r = encode_checked(&p.c[l], cstate[l], B, HID, true, 32, fwd::BN, SW128);
    if (!r) r = encode_checked(&p.hs[l], hseq[l], rows1, HID, false, 32, fwd::BN, SW64);
    const bool paired = pairs && l == layers - 1;
    if (!r)
      r = encode_checked(&p.ys[l], yseq[l], paired ? pair_rows : rows, HID, false, 32, fwd::BN,
                         SW64, paired ? 2 * HID : 0);
    if (!r && paired)
      r = encode_checked(&p.ys_odd, static_cast<__half*>(yseq[l]) + HID, pair_rows, HID, false,
                         32, fwd::BN, SW64, 2 * HID);
    if (!r && factors)
      r = encode_checked(&p.fac[l], factors[l], fwd::N_FACTORS * rows, HID, false, 32, fwd::BN,
                         SW64);
    if (r) return r;
    p.bias[l] = static_cast<const float*>(bias[l]);
    p.h_out[l] = static_cast<__half*>(hseq[l]);
    p.y_out[l] = static_cast<__half*>(yseq[l]);
    p.kin_blocks[l] = kin[l] / fwd::BK;
    p.has_xw[l] = xw[l] != nullptr;
  }
  p.write_factors = factors != nullptr;
  p.T = T;
  p.B = B;
  p.L = layers;
  p.pairs = pairs != 0;
  p.out_lengths = static_cast<const int*>(out_lengths);
  p.keep_scale = 1.f / (1.f - p_drop);
  p.drop_threshold = drop_threshold(p_drop);
  p.seed = static_cast<const uint32_t*>(seed);
  p.active = static_cast<const int*>(active);
  const int smem = fwd::smem_bytes(v.ring);
  static bool smem_done[kFwdCount][kMaxDevices] = {};
  int r = allow_smem(device, v.kernel, smem, smem_done[variant]);
  if (r) return r;
  int ctas[MAX_JOBS];
  stage_ctas(false, layers, B, ctas);
  bool first = true;
  const int n = wave_schedule(layers, T, ctas, sm_count(device), [&](const Jobs& cells) {
    p.jobs = cells_to_jobs(false, layers, T, cells);
    int total = 0;
    for (int j = 0; j < cells.count; ++j) total += ctas[cells.layer[j]];
    const int r = launch(v.kernel, p, total, 1, smem, v.pdl && !first,
                         static_cast<cudaStream_t>(stream));
    first = false;
    return r;
  });
  if (n < 0) return -n;
  return 0;
}

// The backward waves of the same stack (B a multiple of 192). Per layer l:
//   wt[l] [kin[l] + H, 4H] fp16: w[l] transposed;  fac[l]: the forward's factors
//   dz[l] [T*B, 4H] fp16 (written): the gates' gradient, in w[l]'s permuted row order
//   dc[l] [B, H] fp32 (scratch)
//   dbias[l] [T * B / 96, 4H] fp32 (written): dz[l] summed over each 96-row batch tile, in dz's
//             columns; the bias gradient is its column sum
// dy_top [T*B, H] fp16: the gradient of the last layer's yseq; rows at t >= *active are not read
// (active: the forward's) and dz's rows and the partial sums there come out zero. dy_lengths and
// pairs: the forward's out_lengths and pairs (dy_top then in the layout of that yseq, and taken as
// zero where it is zero). The weight gradients, the bias gradients and the input's gradient are
// GEMMs over dz afterwards (lstm_wave.py).
int wave_lstm_backward(int device, int layers, int T, int B, const int* kin, void* const* wt,
                       void* const* dz, void* const* fac, void* const* dc, void* const* dbias,
                       void* dy_top, float p_drop, const void* seed, const void* active,
                       const void* dy_lengths, int pairs, int variant, void* stream) {
  if (variant < 0 || variant >= kBwdCount) return kBadVariant;
  const BwdVariant& v = kBwdVariants[variant];
  if (layers < 1 || layers > bwd::MAX_LAYERS || T < 1 || B < 2 * bwd::BN || B % (2 * bwd::BN) ||
      !(p_drop >= 0.f && p_drop < 1.f))
    return kBadShape;
  for (int l = 0; l < layers; ++l)
    if (kin[l] < bwd::BK || kin[l] % bwd::BK) return kBadShape;
  if (device < 0 || device >= kMaxDevices) return kBadShape;
  const int err = use_device(device);
  if (err) return err;
  bwd::Params p = {};
  const auto SW128 = CU_TENSOR_MAP_SWIZZLE_128B;
  const long rows = static_cast<long>(T) * B;
  for (int l = 0; l < layers; ++l) {
    int r = encode_checked(&p.wt[l], wt[l], kin[l] + HID, 4 * HID, false, bwd::BK, bwd::BM, SW128);
    if (!r) r = encode_checked(&p.dz[l], dz[l], rows, 4 * HID, false, bwd::BK, bwd::BN, SW128);
    if (!r) r = encode_checked(&p.fac[l], fac[l], 6 * rows, HID, false, 64, bwd::BN, SW128);
    if (!r) r = encode_checked(&p.dc[l], dc[l], B, HID, true, 32, bwd::BN, SW128);
    if (r) return r;
    p.kin[l] = kin[l];
    p.dbias[l] = static_cast<float*>(dbias[l]);
    p.dz_out[l] = static_cast<__half*>(dz[l]);
  }
  const long pair_rows = static_cast<long>((T + 1) / 2) * B;
  int r = pairs ? encode_checked(&p.dy, dy_top, pair_rows, HID, false, 64, bwd::BN, SW128, 2 * HID)
                : encode_checked(&p.dy, dy_top, rows, HID, false, 64, bwd::BN, SW128);
  if (!r && pairs)
    r = encode_checked(&p.dy_odd, static_cast<__half*>(dy_top) + HID, pair_rows, HID, false, 64,
                       bwd::BN, SW128, 2 * HID);
  if (r) return r;
  p.T = T;
  p.B = B;
  p.L = layers;
  p.pairs = pairs != 0;
  p.dy_lengths = static_cast<const int*>(dy_lengths);
  p.keep_scale = 1.f / (1.f - p_drop);
  p.drop_threshold = drop_threshold(p_drop);
  p.seed = static_cast<const uint32_t*>(seed);
  p.active = static_cast<const int*>(active);
  const int smem = bwd::smem_bytes(v.ring);
  static bool smem_done[kBwdCount][kMaxDevices] = {};
  r = allow_smem(device, v.kernel, smem, smem_done[variant]);
  if (r) return r;
  int ctas[MAX_JOBS];
  stage_ctas(true, layers, B, ctas);
  bool first = true;
  const int n = wave_schedule(layers, T, ctas, sm_count(device), [&](const Jobs& cells) {
    p.jobs = cells_to_jobs(true, layers, T, cells);
    int total = 0;
    for (int j = 0; j < cells.count; ++j) total += ctas[cells.layer[j]];
    const int r = launch(v.kernel, p, total, 2, smem, v.pdl && !first,
                         static_cast<cudaStream_t>(stream));
    first = false;
    return r;
  });
  return n < 0 ? -n : 0;
}

const char* wave_lstm_error(int code) {
  if (code == kBadShape)
    return "unsupported shape (needs 1 to 3 layers, hidden 1024, T >= 1, a batch that is a "
           "multiple of 96 (forward) and 192 (backward), layer inputs that are multiples of 64 "
           "features, 0 <= p < 1)";
  if (code == kBadVariant) return "no such kernel variant";
  if (code == kNoEncoder) return "the CUDA driver has no cuTensorMapEncodeTiled (needs >= 12.0)";
  if (code >= kEncodeFailed)
    return "cuTensorMapEncodeTiled failed (an operand not 16-byte aligned or not contiguous?)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int wave_lstm_variants(int backward) { return backward ? kBwdCount : kFwdCount; }

// The launches that wave_lstm_forward (backward = 0) or wave_lstm_backward queue for a stack on
// `budget` SMs, for tests: launch i runs cells (layer[3 i + j], t[3 i + j]) for j < count[i].
// Returns the number of launches, or -1 when there are more than max_launches.
int wave_lstm_schedule(int backward, int layers, int T, int B, int budget, int* layer, int* t,
                       int* count, int max_launches) {
  if (layers < 1 || layers > MAX_JOBS || T < 1) return -1;
  int ctas[MAX_JOBS];
  stage_ctas(backward, layers, B, ctas);
  int i = 0;
  const int n = wave_schedule(layers, T, ctas, budget, [&](const Jobs& cells) {
    if (i >= max_launches) return 1;
    const Jobs jobs = cells_to_jobs(backward, layers, T, cells);
    count[i] = jobs.count;
    for (int j = 0; j < jobs.count; ++j) {
      layer[3 * i + j] = jobs.layer[j];
      t[3 * i + j] = jobs.t[j];
    }
    ++i;
    return 0;
  });
  return n < 0 ? -1 : n;
}

// Whether the kernels keep element (t, b, unit) of layer `layer`'s output: the very functions
// the kernels call, on the host, so that tests can hold keep_mask in lstm_wave.py to them.
int wave_lstm_kept(uint32_t seed, int layer, int t, int b, int unit, float p_drop) {
  const uint32_t key = drop_key(step_seed(seed, layer, t), b & ~1, unit);
  return !dropped(key, b & 1, drop_threshold(p_drop));
}

}  // extern "C"
