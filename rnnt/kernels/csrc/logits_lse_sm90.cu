// The fused joint loss's logits GEMM for Hopper (sm_90a), with the softmax statistics in its
// epilogue: C = A B^T in fp16 (A: M x K rows of h, B: N x K = the joint's W) and, per row and
// 128-column tile n, part[row, n] = (max, sum exp2(x - max)) of x = C * scale2 + bias2, the
// logits in base 2 (scale2 = log2(e) / (1 - p), bias2 = log2(e) * bias, both applied to the
// fp16-rounded C exactly as rnnt/kernels/joint_loss_kernels.py's `logit_stats_kernel` applies
// them). The Triton `stats_from_partials_kernel` there turns a row's N / 128 partials into its
// log-sum-exp.
//
// Why a hand-written kernel: with cuBLAS the statistics need a second pass over the logits,
// and a Triton GEMM with the softmax in its epilogue leaves the tensor cores idle while the
// epilogue runs. Here two consumer warp groups take 128 x 128 tiles by turns, so one group's
// epilogue (fp16 rounding, TMA store, partials) runs while the other's MMAs do, with logits
// bitwise equal to cuBLAS's (docs/PERFORMANCE.md, "The sm90 logits GEMM", has the times).
//
// Layout: a persistent grid whose CTA c keeps W's column block c % (N / 128) resident in
// shared memory (K <= 512: 128 KB) for the whole kernel and walks row blocks c / (N / 128),
// + grid / (N / 128), ...; so only A streams, through STAGES 16 KB stages filled by TMA from
// one producer warp. 384 threads: warp group 0 produces (40 registers), groups 1 and 2 consume
// (232 registers: two 64 x 128 fp32 accumulators each).
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90.cuh"

namespace {
using namespace sm90;

constexpr int BM = 128, BN = 128, BK = 64;  // BK: one 128-byte swizzle row of fp16
constexpr int STAGES = 4;
constexpr int MAX_K = 512;
constexpr int A_STAGE_BYTES = BM * BK * 2;
constexpr int B_BLOCK_BYTES = BN * BK * 2;
constexpr int B_BYTES = B_BLOCK_BYTES * (MAX_K / BK);
// Each consumer warp stores its 16 rows of a 64-row half tile as two 64-column TMA boxes.
constexpr int STORE_ROWS = 16;
constexpr int WARP_STORE_BYTES = STORE_ROWS * BN * 2;
constexpr int CONSUMER_STORE_BYTES = 4 * WARP_STORE_BYTES;
constexpr int SMEM_BYTES = STAGES * A_STAGE_BYTES + B_BYTES + 2 * CONSUMER_STORE_BYTES +
                           (2 * STAGES + 3) * 8 + 1024;  // + mbarriers + 1024-byte alignment
constexpr int THREADS = 384;
constexpr float LOG2E = 1.4426950408889634f;
// Error codes of logits_lse_launch beside cudaError_t's (all below 1000).
constexpr int kBadShape = 100000, kNoEncoder = 100001, kEncodeFailed = 200000;
constexpr int kMaxDevices = 64;

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
__device__ __forceinline__ void fence_accumulators(float* d) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 128 fp32, this thread's 64 values) += A (64 x 16) B (16 x 128)^T, both K-major fp16
// operands in shared memory; scale_d == 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n128k16(float* d, uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0; }"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One 64-row half of a tile, each warp its own 16 rows (this thread: rows row and row + 8,
// 32 columns each): the fp16 logits into the warp's staging buffer (128-byte swizzle, as the
// store's tensor map reads it) and out with two TMA stores, then the rows' base-2 partials
// while the stores read the buffer.
__device__ __forceinline__ void store_half_tile(const float* d, int row, int warp_row0, int n,
                                                int M, int n_tiles, float2* part,
                                                const float* bias2, float scale2, int lane,
                                                uint8_t* warp_stage, const CUtensorMap* map_c) {
  if (lane == 0) bulk_wait_read();
  __syncwarp();
  const uint32_t stage = smem_u32(warp_stage);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      __half2 pair = __floats2half2_rn(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]);
      const uint32_t off = (j / 8) * (STORE_ROWS * 128) + ((lane >> 2) + 8 * i) * 128 +
                           (((j % 8) ^ (lane >> 2)) * 16) + 4 * (lane & 3);
      st_shared_b32(stage + off, *reinterpret_cast<uint32_t*>(&pair));
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (lane == 0) {
    tma_store_2d(map_c, warp_stage, n * BN, warp_row0);
    tma_store_2d(map_c, warp_stage + STORE_ROWS * 128, n * BN + 64, warp_row0);
    bulk_commit();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float x[32];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 c = __half22float2(__floats2half2_rn(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]));
      x[2 * j] = fmaf(c.x, scale2, bias2[2 * j]);
      x[2 * j + 1] = fmaf(c.y, scale2, bias2[2 * j + 1]);
    }
    float top = x[0];
#pragma unroll
    for (int k = 1; k < 32; ++k) top = fmaxf(top, x[k]);
    // the four lanes of a row hold its 128 columns
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < 32; ++k) sum += fast_exp2(x[k] - top);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = row + 8 * i;
    if (r < M && (lane & 3) == 0) part[static_cast<size_t>(r) * n_tiles + n] = make_float2(top, sum);
  }
}

__global__ void __launch_bounds__(THREADS, 1)
    logits_lse_kernel(const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b,
                      const __grid_constant__ CUtensorMap map_c, float2* part, const float* bias,
                      float scale2, int M, int N, int K) {
  extern __shared__ uint8_t raw[];
  uint8_t* a_stages = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(raw) + 1023) & ~static_cast<uintptr_t>(1023));
  uint8_t* b_block = a_stages + STAGES * A_STAGE_BYTES;
  uint8_t* store_stage = b_block + B_BYTES;
  uint64_t* full = reinterpret_cast<uint64_t*>(store_stage + 2 * CONSUMER_STORE_BYTES);
  uint64_t* empty = full + STAGES;
  // order[c]: the other consumer has issued its tile's MMAs. The mainloops take turns: without
  // that a consumer can wait on a stage barrier two phases ahead and never see it complete.
  uint64_t* order = empty + STAGES;
  uint64_t* b_full = order + 2;
  const int warp_group = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int n_tiles = N / BN, k_blocks = K / BK, m_tiles = (M + BM - 1) / BM;
  const int n = blockIdx.x % n_tiles, m_first = blockIdx.x / n_tiles;
  const int m_step = gridDim.x / n_tiles;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);  // one arrival per consumer warp
    }
    mbar_init(&order[0], 4);
    mbar_init(&order[1], 4);
    mbar_init(b_full, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp_group == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      mbar_expect_tx(b_full, B_BLOCK_BYTES * k_blocks);
      for (int kb = 0; kb < k_blocks; ++kb)
        tma_load_2d(b_block + kb * B_BLOCK_BYTES, &map_b, b_full, kb * BK, n * BN);
      uint32_t q = 0;
      for (int m = m_first; m < m_tiles; m += m_step) {
        for (int kb = 0; kb < k_blocks; ++kb, ++q) {
          const int s = q % STAGES;
          mbar_wait(&empty[s], ((q / STAGES) & 1) ^ 1);
          mbar_expect_tx(&full[s], A_STAGE_BYTES);
          tma_load_2d(a_stages + s * A_STAGE_BYTES, &map_a, &full[s], kb * BK, m * BM);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warp_group - 1, warp = tid / 32, lane = tid % 32;
  float d0[64], d1[64];  // rows 0-63 and 64-127 of the tile
  float bias2[32];       // this thread's 32 columns of the CTA's block
  const int col0 = n * BN + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    bias2[2 * j] = bias[col0 + 8 * j] * LOG2E;
    bias2[2 * j + 1] = bias[col0 + 8 * j + 1] * LOG2E;
  }
  uint8_t* warp_stage = store_stage + consumer * CONSUMER_STORE_BYTES + warp * WARP_STORE_BYTES;
  mbar_wait(b_full, 0);
  int turn = 0;
  for (int m = m_first, tile = 0; m < m_tiles; m += m_step, ++tile) {
    if ((tile & 1) != consumer) continue;
    if (consumer == 1) {
      mbar_wait(&order[1], turn & 1);
    } else if (turn > 0) {
      mbar_wait(&order[0], (turn - 1) & 1);
    }
    ++turn;
    const uint32_t q = static_cast<uint32_t>(tile) * k_blocks;
    for (int kb = 0; kb < k_blocks; ++kb) {
      const uint32_t qq = q + kb;
      const int s = qq % STAGES;
      mbar_wait(&full[s], (qq / STAGES) & 1);
      const uint32_t a = smem_u32(a_stages + s * A_STAGE_BYTES);
      const uint32_t b = smem_u32(b_block + kb * B_BLOCK_BYTES);
      wgmma_fence();
      fence_accumulators(d0);
      fence_accumulators(d1);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const int accumulate = (kb | kk) != 0;
        wgmma_m64n128k16(d0, smem_desc(a + kk * 32), smem_desc(b + kk * 32), accumulate);
        wgmma_m64n128k16(d1, smem_desc(a + 64 * 128 + kk * 32), smem_desc(b + kk * 32),
                         accumulate);
      }
      wgmma_commit();
      fence_accumulators(d0);
      fence_accumulators(d1);
      if (kb > 0) {  // the previous stage's MMAs are done: hand it back to the producer
        wgmma_wait<1>();
        if (lane == 0) mbar_arrive(&empty[(qq - 1) % STAGES]);
      }
    }
    if (lane == 0) mbar_arrive(&order[consumer ^ 1]);
    wgmma_wait<0>();
    fence_accumulators(d0);
    fence_accumulators(d1);
    if (lane == 0) mbar_arrive(&empty[(q + k_blocks - 1) % STAGES]);
    const int row = m * BM + 16 * warp + (lane >> 2);
    store_half_tile(d0, row, m * BM + 16 * warp, n, M, n_tiles, part, bias2, scale2, lane,
                    warp_stage, &map_c);
    store_half_tile(d1, row + 64, m * BM + 64 + 16 * warp, n, M, n_tiles, part, bias2, scale2,
                    lane, warp_stage, &map_c);
  }
  if (lane == 0) bulk_wait_all();
}

// rows x cols fp16, row-major; boxes of box_rows x 64 columns, 128-byte swizzled. Out-of-range
// rows load as zeros and are not stored.
int encode_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows) {
  if (!encoder()) return kNoEncoder;
  const CUresult r = encode_2d(map, ptr, rows, cols, false, BK, box_rows, CU_TENSOR_MAP_SWIZZLE_128B);
  return r == CUDA_SUCCESS ? 0 : kEncodeFailed + static_cast<int>(r);
}

}  // namespace

extern "C" {

// Launches on `stream` of `device` (all pointers on that device, 16-byte aligned, contiguous):
// C (M x N fp16) = A (M x K fp16) B (N x K fp16)^T and part (M x N / 128 x 2 fp32) as above;
// bias (N fp32). `grid` must be a multiple of N / 128 (one CTA per SM at most is resident).
// Returns 0, or an error code that `logits_lse_error` describes.
int logits_lse_launch(const void* A, const void* B, void* C, void* part, const float* bias,
                      float scale2, int M, int N, int K, int grid, int device, void* stream) {
  if (M < 1 || N < BN || N % BN || K < BK || K % BK || K > MAX_K || grid < N / BN ||
      grid % (N / BN))
    return kBadShape;
  if (device < 0 || device >= kMaxDevices) return kBadShape;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  CUtensorMap map_a, map_b, map_c;
  int r = encode_map(&map_a, A, M, K, BM);
  if (!r) r = encode_map(&map_b, B, N, K, BN);
  if (!r) r = encode_map(&map_c, C, M, N, STORE_ROWS);
  if (r) return r;
  static bool configured[kMaxDevices] = {};
  if (!configured[device]) {
    err = cudaFuncSetAttribute(logits_lse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured[device] = true;
  }
  logits_lse_kernel<<<grid, THREADS, SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(
      map_a, map_b, map_c, static_cast<float2*>(part), bias, scale2, M, N, K);
  return static_cast<int>(cudaGetLastError());
}

const char* logits_lse_error(int code) {
  if (code == kBadShape)
    return "unsupported shape or launch (needs N % 128 == 0, K % 64 == 0, K <= 512, M >= 1 and "
           "a grid that is a multiple of N / 128)";
  if (code == kNoEncoder) return "the CUDA driver has no cuTensorMapEncodeTiled (needs >= 12.0)";
  if (code >= kEncodeFailed)
    return "cuTensorMapEncodeTiled failed (an operand not 16-byte aligned or not contiguous?)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int logits_lse_smem_bytes() { return SMEM_BYTES; }

}  // extern "C"
