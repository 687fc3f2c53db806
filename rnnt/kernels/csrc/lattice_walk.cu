// The fused loss's lattice walk in CUDA C++: alpha, beta and log P of a chunk's utterances,
// the same arithmetic as rnnt/kernels/joint_loss_kernels.py's Triton `lattice_kernel` (bitwise
// the same outputs), which stays the reference and the fallback.
//
// Why: the walk is a chain of T_b + U_b dependent steps per utterance, one warp each, so its
// time is the latency of one step. With diagonal-major inputs (the stats kernels store them
// there) read as vectors four diagonals ahead, a step of the alpha walk took 150 ns on an H200
// (probe, (204, 44) utterances), against 320-400 ns for the Triton kernel on the row layout.
// It takes both: this kernel on the row layout took 280-305 ns, and the Triton kernel on
// diagonal-major inputs was slower than on rows (docs/PERFORMANCE.md).
//
// Layout (int64 cell indices), of the inputs and of alpha and beta: utterance b's cell (t, u)
// at sfirst + n width + u for its diagonal n = t + u (packed: sfirst = soffs[b], width =
// U_b + 1 rounded up to 4; padded: sfirst = b (T + U1) width, width = U1 rounded up to 4), so a
// diagonal's loads and stores are contiguous. The inputs hold lp_blank[t - 1, u] and
// lp_label[t, u - 1] at (t, u): the moves into the cell (joint_loss._diagonals).
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr double NEG = -1e30;  // log 0, as in joint_loss.py
constexpr float NEG_F = -1e30f;
constexpr float LOG2E = 1.4426950408889634f;
constexpr double LN2 = 0.6931471805599453;
constexpr unsigned FULL = 0xffffffffu;
constexpr int AHEAD = 4;  // diagonals loaded ahead of their step
constexpr int ALIGN = 4;  // joint_loss.SKEW_ALIGN
constexpr int kBadShape = 100000;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// log(e^a + e^b): the max and the sum in fp64, the correction in fp32 (joint_loss._logaddexp)
__device__ __forceinline__ double logaddexp(double a, double b) {
  const double top = fmax(a, b);
  const float x = 1.0f + ex2(-static_cast<float>(fabs(a - b)) * LOG2E);
  return top + static_cast<double>(lg2(x)) * LN2;
}

// E consecutive fp32 lanes from an E * 4-byte aligned address (E = 1, 2, 4 or 8)
template <int E>
__device__ __forceinline__ void load_lanes(const float* __restrict__ p, float* out) {
  if constexpr (E == 1) {
    out[0] = __ldg(p);
  } else if constexpr (E == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    out[0] = v.x, out[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < E; i += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p + i));
      out[i] = v.x, out[i + 1] = v.y, out[i + 2] = v.z, out[i + 3] = v.w;
    }
  }
}

// One warp per (utterance b0 + blockIdx.x, direction blockIdx.y); lane l holds lanes
// u = l E .. l E + E - 1 of the current diagonal (so U1 <= 32 E).
template <int E>
__global__ void __launch_bounds__(32) walk_kernel(
    const float* __restrict__ skb, const float* __restrict__ skl, const int* __restrict__ soffs,
    const int* __restrict__ flen, const int* __restrict__ tlen,
    double* __restrict__ alpha, double* __restrict__ beta, double* __restrict__ log_lik, int b0,
    int T, int U1, int packed) {
  const int b = b0 + blockIdx.x;
  const int lane = threadIdx.x;
  const int t_len = flen[b], u_len = tlen[b];
  int64_t sfirst, width;
  if (packed) {
    sfirst = soffs[b], width = (u_len + ALIGN) / ALIGN * ALIGN;
  } else {
    width = (U1 + ALIGN - 1) / ALIGN * ALIGN;
    sfirst = static_cast<int64_t>(b) * (T + U1) * width;
  }
  const int n_diag = t_len + u_len;
  const int u0 = lane * E;
  const float* pb = skb + sfirst + u0;
  const float* pl = skl + sfirst + u0;
  float rb[AHEAD][E], rl[AHEAD][E];
  double v[E];
  if (blockIdx.y == 0) {
    // alpha[t, u] = logaddexp(alpha[t-1, u] + lp_blank[t-1, u], alpha[t, u-1] + lp_label[t, u-1])
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = u0 + e == 0 ? 0.0 : NEG;
    if (lane == 0) alpha[sfirst] = 0.0;
#pragma unroll
    for (int k = 0; k < AHEAD; ++k) {
      const int64_t n = min(1 + k, n_diag);
      load_lanes<E>(pb + n * width, rb[k]);
      load_lanes<E>(pl + n * width, rl[k]);
    }
    for (int n0 = 1; n0 < n_diag; n0 += AHEAD) {
#pragma unroll
      for (int k = 0; k < AHEAD; ++k) {
        const int n = n0 + k;
        if (n >= n_diag) break;
        double left = __shfl_up_sync(FULL, v[E - 1], 1);
        if (lane == 0) left = v[0];
        double next[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int u = u0 + e, t = n - u;
          const bool ok = t >= 0 && t < t_len && u <= u_len;
          const float lb = t >= 1 ? rb[k][e] : NEG_F;
          const float ll = u >= 1 ? rl[k][e] : NEG_F;
          const double x = logaddexp(v[e] + lb, (e == 0 ? left : v[e - 1]) + ll);
          next[e] = ok ? x : NEG;
          if (ok) alpha[sfirst + n * width + u] = x;
        }
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = next[e];
        const int64_t ahead = min(n + AHEAD, n_diag);
        load_lanes<E>(pb + ahead * width, rb[k]);
        load_lanes<E>(pl + ahead * width, rl[k]);
      }
    }
  } else {
    // beta[t, u] = logaddexp(beta[t+1, u] + lp_blank[t, u], beta[t, u+1] + lp_label[t, u]),
    // diagonals n_diag - 1 down to 0 (the moves out of diagonal d are stored on d + 1); the
    // final blank from (T_b - 1, U_b) leaves with probability one
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = u0 + e == u_len ? 0.0 : NEG;
    float shifted[E];
#pragma unroll
    for (int k = 0; k < AHEAD; ++k) {
      const int64_t n = max(n_diag - k, 0);
      load_lanes<E>(pb + n * width, rb[k]);
      load_lanes<E>(pl + n * width, rl[k]);
    }
    for (int d0 = n_diag - 1; d0 >= 0; d0 -= AHEAD) {
#pragma unroll
      for (int k = 0; k < AHEAD; ++k) {
        const int d = d0 - k;
        if (d < 0) break;
        const double right = __shfl_down_sync(FULL, v[0], 1);
        // lp_label[t, u] sits at (t, u + 1): one lane to the right
        const float from_next = __shfl_down_sync(FULL, rl[k][0], 1);
#pragma unroll
        for (int e = 0; e < E; ++e) shifted[e] = e + 1 < E ? rl[k][e + 1] : from_next;
        double next[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int u = u0 + e, t = d - u;
          const bool ok = t >= 0 && t < t_len && u <= u_len;
          const float lb = ok ? rb[k][e] : NEG_F;
          const float ll = ok && u < u_len ? shifted[e] : NEG_F;
          const double x = logaddexp(v[e] + lb, (e + 1 < E ? v[e + 1] : right) + ll);
          next[e] = ok ? x : NEG;
          if (ok) beta[sfirst + d * width + u] = x;
        }
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = next[e];
        const int64_t ahead = max(d + 1 - AHEAD, 0);
        load_lanes<E>(pb + ahead * width, rb[k]);
        load_lanes<E>(pl + ahead * width, rl[k]);
      }
    }
    if (lane == 0) log_lik[b] = v[0];
  }
}

template <int E>
int launch(const float* skb, const float* skl, const int* soffs, const int* flen, const int* tlen,
           double* alpha, double* beta, double* log_lik, int b0, int bc, int T, int U1, int packed,
           cudaStream_t stream) {
  walk_kernel<E><<<dim3(bc, 2), 32, 0, stream>>>(skb, skl, soffs, flen, tlen, alpha, beta,
                                                 log_lik, b0, T, U1, packed);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// The widest lattice (U_max + 1 label states) a launch takes.
int lattice_walk_max_u1() { return 32 * 8; }

// Walks utterances [b0, b0 + bc) on `stream` of `device`; the diagonal-major inputs must have
// 32 * 8 readable cells past their last one (lanes past a diagonal's width are read, not used).
// Returns 0, or an error code that `lattice_walk_error` describes.
int lattice_walk_launch(const float* skb, const float* skl, const int* soffs, const int* flen,
                        const int* tlen, double* alpha, double* beta, double* log_lik, int b0,
                        int bc, int T, int U1, int packed, int device, void* stream) {
  if (bc < 1 || b0 < 0 || T < 1 || U1 < 1 || U1 > lattice_walk_max_u1()) return kBadShape;
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const auto run = U1 <= 32 ? launch<1> : U1 <= 64 ? launch<2> : U1 <= 128 ? launch<4> : launch<8>;
  return run(skb, skl, soffs, flen, tlen, alpha, beta, log_lik, b0, bc, T, U1, packed, s);
}

const char* lattice_walk_error(int code) {
  if (code == kBadShape) return "bad launch shape (utterances, T or U + 1 out of range)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
