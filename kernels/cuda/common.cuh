#pragma once
// Internal to kernels/cuda: launch checking and small device helpers shared by the kernels.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "batchlm/kernels/cuda.hpp"

namespace batchlm::kernels::cuda::detail {

inline constexpr int kWarp = 32;

// Checks the launch just made (a bad configuration shows here, a fault at the next sync).
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// it. `shared` holds 32 floats; the call synchronises the block twice.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  v = lane < warps ? shared[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float half_bits_to_float(std::uint16_t h) {
  return __half2float(__ushort_as_half(h));
}

__host__ __device__ constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace batchlm::kernels::cuda::detail
