#pragma once
// Shared by the GPU tests: skip (reported as skipped by CTest) where no usable device is
// present, and small device-memory helpers that check every CUDA call.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "batchlm/kernels/cuda.hpp"

namespace batchlm::gpu_test {

namespace kc = batchlm::kernels::cuda;

// In a test body: GTEST_SKIP()s with the reason when there is no usable GPU.
#define BATCHLM_REQUIRE_GPU()                                               \
  do {                                                                      \
    std::string why_not_;                                                   \
    if (!::batchlm::kernels::cuda::probe(why_not_)) GTEST_SKIP() << why_not_; \
  } while (0)

// A device buffer of n T, freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    kc::check(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    kc::check(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    kc::check(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // Fills every byte with `byte` (0xff: a NaN for floats), so an unwritten output shows.
  void poison(int byte = 0xff) { kc::check(cudaMemset(p_, byte, n_ * sizeof(T)), "poison"); }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

// Waits for the stream's work and reports a fault from any kernel in it.
inline void sync() { kc::check(cudaDeviceSynchronize(), "synchronize"); }

// ||a - b|| / ||b|| over all elements; NaN anywhere gives NaN (which fails any bound).
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

inline std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace batchlm::gpu_test
