#pragma once
// For the kernel tests: the SIMD paths this CPU and build have, and a bit-for-bit comparison of
// their results with the portable path's.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../../../kernels/cpu/cpu_kernels.hpp"

namespace batchlm::kernels::testing {

// AVX2, AVX-VNNI and AVX-512VL, those present.
inline std::vector<const cpu::Kernels*> simd_paths() {
  std::vector<const cpu::Kernels*> paths;
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  return paths;
}

// Whether a[0..n) and b[0..n) are the same bits; where says at which element they part.
inline bool same_bits(const float* a, const float* b, std::size_t n, std::string* where) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) {
      *where = "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
      return false;
    }
  return true;
}
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::string* where) {
  return same_bits(a.data(), b.data(), a.size(), where);
}

}  // namespace batchlm::kernels::testing
