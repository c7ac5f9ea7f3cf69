// Finding a usable device, and turning CUDA errors into exceptions.

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace batchlm::kernels::cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  // Clear a sticky launch error so the next call reports its own.
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

std::optional<DeviceInfo> probe(std::string& why_not) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    why_not = std::string("no usable CUDA driver (") + cudaGetErrorString(e) + ")";
    return std::nullopt;
  }
  if (count == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    why_not = visible != nullptr ? std::string("no CUDA device (CUDA_VISIBLE_DEVICES=") + visible + ")"
                                 : "no CUDA device";
    return std::nullopt;
  }
  cudaDeviceProp p{};
  if (const cudaError_t e = cudaGetDeviceProperties(&p, 0); e != cudaSuccess) {
    (void)cudaGetLastError();
    why_not = std::string("cannot read device 0 (") + cudaGetErrorString(e) + ")";
    return std::nullopt;
  }
  // The kernels use F16 tensor cores through WMMA and the build carries sm_80 PTX at the
  // lowest: older devices cannot run it.
  if (p.major < 8) {
    why_not = std::string(p.name) + " has compute capability " + std::to_string(p.major) + "." +
              std::to_string(p.minor) + "; this build needs 8.0 or newer";
    return std::nullopt;
  }
  DeviceInfo info;
  info.ordinal = 0;
  info.name = p.name;
  info.sm_major = p.major;
  info.sm_minor = p.minor;
  info.multiprocessors = p.multiProcessorCount;
  info.l2_bytes = static_cast<std::size_t>(p.l2CacheSize);
  if (const cudaError_t e = cudaSetDevice(0); e != cudaSuccess) {
    (void)cudaGetLastError();
    why_not = std::string("cannot use ") + p.name + " (" + cudaGetErrorString(e) + ")";
    return std::nullopt;
  }
  if (const cudaError_t e = cudaMemGetInfo(&info.memory_free, &info.memory_total); e != cudaSuccess) {
    (void)cudaGetLastError();
    why_not = std::string("cannot read the memory of ") + p.name + " (" + cudaGetErrorString(e) + ")";
    return std::nullopt;
  }
  return info;
}

}  // namespace batchlm::kernels::cuda
