// gpu_kernels_bench: the CUDA matrix products (cuda.hpp) on 1B-class shapes, next to the
// ceilings measured on the same device:
//   - matvec (n = 1 and n = 8): median time per product, the bytes it must move (weights in
//     their device layout + x + y), achieved GB/s and its share of the device-to-device memcpy
//     bandwidth (bytes read + written).
//   - tensor-core path (n = 64, 256, 512): TFLOP/s (2 * rows * cols * n / time; our time
//     includes the x -> F16 conversion and, for few-tile shapes, the split-k sum) per weight
//     type, next to cuBLAS cublasGemmEx F16 x F16 -> F32 (compute 32F, default algorithm) on
//     the same shape with F16 inputs.
// Timing: each sample is one CUDA-graph launch of K products, timed with CUDA events, divided
// by K; the median of the samples after warm-up is reported. The products cycle over copies of
// the weights whose total exceeds 3 x the L2 size (read from the device), so the weights come
// from DRAM as in a real forward pass.
//
// --check first compares every (shape, type) with the CPU kernels::matmul (n = 1, 8 and 64;
// relative L2 error bound 2e-2) and cuBLAS with our F16 product, and fails (exit 1) on a
// mismatch.
//
// Usage: gpu_kernels_bench [--check] [--samples N] [--quick]
//   --quick: only the two smaller shapes (a fast smoke run).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/cuda.hpp"
#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"

namespace {

namespace kc = batchlm::kernels::cuda;
using batchlm::kernels::DType;

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLAS: ") + what + ": status " + std::to_string(s));
  }
}

struct Shape {
  std::int64_t rows, cols;
};

// Q5_0 and Q5_1 go up in the layouts of Q8_0 and Q5_K (cuda.hpp): the same kernels, not timed
// again.
const DType kTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q4_K, DType::Q5_K,
                        DType::Q6_K, DType::F16,  DType::BF16, DType::F32};

// A fast deterministic generator (xorshift64*): the large matrices have 10^8+ elements.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  float uniform() {  // [-1, 1)
    return static_cast<float>(next() >> 40) / static_cast<float>(1u << 23) - 1.0f;
  }
};

// Random weights in GGUF layout: quants uniform, scales about 0.02 (so values are about the
// size of real weights), float types uniform in [-0.04, 0.04).
std::vector<unsigned char> random_weights(DType type, const Shape& s, std::uint64_t seed) {
  using namespace batchlm::kernels;
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  const std::size_t bytes = row_bytes(type, s.cols) * static_cast<std::size_t>(s.rows);
  std::vector<unsigned char> out(bytes);
  const std::size_t elems = static_cast<std::size_t>(s.rows * s.cols);
  switch (type) {
    case DType::F32:
      for (std::size_t i = 0; i < elems; ++i) {
        const float v = 0.04f * rng.uniform();
        std::memcpy(out.data() + 4 * i, &v, 4);
      }
      break;
    case DType::F16:
    case DType::BF16:
      for (std::size_t i = 0; i < elems; ++i) {
        const float v = 0.04f * rng.uniform();
        const std::uint16_t h = type == DType::F16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
    default: {
      const std::size_t bb = block_bytes(type);
      for (std::size_t b = 0; b < bytes / bb; ++b) {
        unsigned char* blk = out.data() + b * bb;
        for (std::size_t j = 0; j < bb; j += 8) {
          const std::uint64_t r = rng.next();
          std::memcpy(blk + j, &r, std::min<std::size_t>(8, bb - j));
        }
        // The K types' integer sub-block scales (random bytes here, up to 63 or 127) multiply d.
        const bool k = type == DType::Q4_K || type == DType::Q5_K || type == DType::Q6_K;
        const float d = 0.02f * (1.5f + 0.5f * rng.uniform()) /
                        (type == DType::Q8_0 ? 16.0f : k ? 64.0f : 1.0f);
        const std::uint16_t dh = fp32_to_fp16(d);
        // Q6_K keeps its d last; the others first.
        std::memcpy(blk + (type == DType::Q6_K ? bb - 2 : 0), &dh, 2);
        if (type == DType::Q4_1 || type == DType::Q4_K || type == DType::Q5_K) {
          // Q4_1's min, the K types' dmin.
          const std::uint16_t mh = fp32_to_fp16(type == DType::Q4_1 ? -8.0f * d : 8.0f * d);
          std::memcpy(blk + 2, &mh, 2);
        }
      }
    }
  }
  return out;
}

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  Rng rng{seed * 0x2545F4914F6CDD1Dull + 7};
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform();
  return v;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

template <typename T>
struct DevMem {
  T* p = nullptr;
  explicit DevMem(std::size_t n) {
    kc::check(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)),
              "cudaMalloc");
  }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
};

// Times `body` (which enqueues `per_sample` operations on `stream`) as a captured graph:
// returns the median over `samples` of (graph time / per_sample), in milliseconds.
template <typename Body>
double time_graph(cudaStream_t stream, int per_sample, int samples, Body&& body) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  kc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  body();
  kc::check(cudaStreamEndCapture(stream, &graph), "end capture");
  kc::check(cudaGraphInstantiate(&exec, graph, 0), "graph instantiate");
  cudaEvent_t start, stop;
  kc::check(cudaEventCreate(&start), "event");
  kc::check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 3; ++i) kc::check(cudaGraphLaunch(exec, stream), "warm-up");
  std::vector<double> ms;
  for (int i = 0; i < samples; ++i) {
    kc::check(cudaEventRecord(start, stream), "record");
    kc::check(cudaGraphLaunch(exec, stream), "graph launch");
    kc::check(cudaEventRecord(stop, stream), "record");
    kc::check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    kc::check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    ms.push_back(static_cast<double>(t) / per_sample);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Copies of one matrix on the device, enough that cycling over them exceeds 3 x L2.
struct WeightCopies {
  std::vector<DevMem<unsigned char>*> buffers;
  std::vector<kc::DeviceMatrix> matrices;
  std::size_t bytes = 0;  // of one copy
  WeightCopies(const batchlm::kernels::Matrix& host, std::size_t l2_bytes, std::size_t max_total) {
    bytes = kc::device_bytes(host);
    std::size_t count = std::max<std::size_t>(1, (3 * l2_bytes + bytes - 1) / bytes);
    count = std::min(count, std::max<std::size_t>(1, max_total / bytes));
    for (std::size_t i = 0; i < count; ++i) {
      buffers.push_back(new DevMem<unsigned char>(bytes));
      matrices.push_back(kc::upload(host, buffers.back()->p));
    }
  }
  ~WeightCopies() {
    for (auto* b : buffers) delete b;
  }
  WeightCopies(const WeightCopies&) = delete;
  WeightCopies& operator=(const WeightCopies&) = delete;
};

struct Options {
  bool check = false;
  bool quick = false;
  int samples = 15;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      o.check = true;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--samples" && i + 1 < argc) {
      o.samples = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--check] [--samples N] [--quick]\n", argv[0]);
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  return o;
}

std::string shape_name(const Shape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.cols);
}

int run(const Options& opt) {
  std::string why_not;
  const auto info = kc::probe(why_not);
  if (!info) {
    std::fprintf(stderr, "no usable GPU: %s\n", why_not.c_str());
    return 77;
  }
  std::printf("device: %s (sm_%d%d), %d SMs, L2 %.1f MiB, memory %.1f GiB (%.1f free)\n",
              info->name.c_str(), info->sm_major, info->sm_minor, info->multiprocessors,
              static_cast<double>(info->l2_bytes) / (1 << 20),
              static_cast<double>(info->memory_total) / (1 << 30),
              static_cast<double>(info->memory_free) / (1 << 30));
  // Device memory the weight copies may take: a quarter of what is free, at most 8 GiB.
  const std::size_t max_total = std::min<std::size_t>(info->memory_free / 4, std::size_t{8} << 30);

  cudaStream_t stream = nullptr;
  kc::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cublasHandle_t cublas = nullptr;
  check_cublas(cublasCreate(&cublas), "create");
  check_cublas(cublasSetStream(cublas, stream), "set stream");
  // An explicit workspace, so that cuBLAS allocates nothing while a graph is being captured.
  const std::size_t cublas_workspace_bytes = std::size_t{64} << 20;
  DevMem<unsigned char> cublas_workspace(cublas_workspace_bytes);
  check_cublas(cublasSetWorkspace(cublas, cublas_workspace.p, cublas_workspace_bytes), "workspace");

  // ---- memcpy ceiling
  double memcpy_gbs = 0;
  {
    const std::size_t bytes = std::min<std::size_t>(std::size_t{1} << 30, info->memory_free / 8);
    DevMem<unsigned char> a(bytes), b(bytes);
    kc::check(cudaMemset(a.p, 1, bytes), "memset");
    kc::check(cudaDeviceSynchronize(), "sync");
    const double ms = time_graph(stream, 2, opt.samples, [&] {
      kc::check(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
      kc::check(cudaMemcpyAsync(a.p, b.p, bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
    });
    memcpy_gbs = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    std::printf("memcpy D2D %zu MiB: %.3f ms, %.0f GB/s (bytes read + written)\n\n", bytes >> 20,
                ms, memcpy_gbs);
  }

  std::vector<Shape> shapes = {{2048, 2048}, {8192, 2048}, {2048, 8192}, {128256, 2048}};
  if (opt.quick) shapes.resize(2);
  const std::int64_t tc_tokens[] = {64, 256, 512};
  batchlm::kernels::ThreadPool pool(0);
  bool ok = true;

  // ---- --check: every shape and type against the CPU, before any timing.
  if (opt.check) {
    std::printf("check against the CPU kernels::matmul (relative L2 error, bound 2e-2)\n");
    for (const Shape& s : shapes) {
      for (const DType type : kTypes) {
        const std::vector<unsigned char> host_bytes = random_weights(type, s, 11);
        batchlm::kernels::Matrix host;
        host.type = type;
        host.data = host_bytes.data();
        host.rows = s.rows;
        host.cols = s.cols;
        DevMem<unsigned char> dw(kc::device_bytes(host));
        const kc::DeviceMatrix w = kc::upload(host, dw.p);
        std::printf("  %-12s %-5s", shape_name(s).c_str(),
                    std::string(batchlm::kernels::to_string(type)).c_str());
        for (const std::int64_t n : {std::int64_t{1}, std::int64_t{8}, std::int64_t{64}}) {
          const std::vector<float> x = random_floats(static_cast<std::size_t>(n * s.cols), 5 + n);
          DevMem<float> dx(x.size()), dy(static_cast<std::size_t>(n * s.rows));
          DevMem<unsigned char> scratch(kc::matmul_scratch_bytes(w, n));
          kc::check(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice), "copy");
          kc::check(cudaMemset(dy.p, 0xff, static_cast<std::size_t>(n * s.rows) * 4), "poison");
          kc::matmul(w, dx.p, n, dy.p, scratch.p, stream);
          kc::check(cudaStreamSynchronize(stream), "sync");
          std::vector<float> y(static_cast<std::size_t>(n * s.rows)), ref(y.size());
          kc::check(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), "copy");
          std::vector<unsigned char> act(batchlm::kernels::activation_bytes(host, n) + 64);
          batchlm::kernels::matmul(host, x.data(), n, ref.data(), act.data(), pool);
          const double err = relative_error(y, ref);
          const bool pass = err < 2e-2;  // NaN fails
          ok = ok && pass;
          std::printf("  n=%-3lld %.2e %s", static_cast<long long>(n), err, pass ? "ok" : "FAIL");
        }
        std::printf("\n");
      }
    }
    std::printf("\n");
  }

  // ---- matvec
  std::printf(
      "matvec: median per product; weights cycled over copies > 3 x L2;\n"
      "MB = bytes moved (weights in device layout + x + y); %% = of memcpy GB/s\n");
  std::printf("%-12s %-5s %9s %7s %9s %8s %6s %9s %8s %6s\n", "rows x cols", "type", "MB", "copies",
              "n=1 us", "GB/s", "%", "n=8 us", "GB/s", "%");
  for (const Shape& s : shapes) {
    for (const DType type : kTypes) {
      const std::vector<unsigned char> host_bytes = random_weights(type, s, 3);
      batchlm::kernels::Matrix host;
      host.type = type;
      host.data = host_bytes.data();
      host.rows = s.rows;
      host.cols = s.cols;
      const WeightCopies copies(host, info->l2_bytes, max_total);
      std::printf("%-12s %-5s %9.2f %7zu", shape_name(s).c_str(),
                  std::string(batchlm::kernels::to_string(type)).c_str(),
                  static_cast<double>(copies.bytes) / 1e6, copies.matrices.size());
      for (const std::int64_t n : {std::int64_t{1}, std::int64_t{8}}) {
        DevMem<float> dx(static_cast<std::size_t>(n * s.cols)),
            dy(static_cast<std::size_t>(n * s.rows));
        kc::check(cudaMemset(dx.p, 0, static_cast<std::size_t>(n * s.cols) * 4), "memset");
        const int k = static_cast<int>(std::max<std::size_t>(copies.matrices.size(), 20));
        const double ms = time_graph(stream, k, opt.samples, [&] {
          for (int i = 0; i < k; ++i) {
            kc::matmul(copies.matrices[static_cast<std::size_t>(i) % copies.matrices.size()], dx.p,
                       n, dy.p, nullptr, stream);
          }
        });
        const double moved =
            static_cast<double>(copies.bytes) + 4.0 * static_cast<double>(n * s.cols + n * s.rows);
        const double gbs = moved / (ms * 1e-3) / 1e9;
        std::printf(" %9.2f %8.0f %6.1f", ms * 1e3, gbs, 100.0 * gbs / memcpy_gbs);
      }
      std::printf("\n");
    }
  }

  // ---- tensor cores vs cuBLAS
  std::printf(
      "\ntensor-core path: TFLOP/s = 2 * rows * cols * n / time (ours: x -> F16 included);\n"
      "cuBLAS: cublasGemmEx F16 x F16 -> F32, compute 32F, on F16 copies of the same shape\n");
  std::printf("%-12s %4s", "rows x cols", "n");
  for (const DType type : kTypes)
    std::printf(" %7s", std::string(batchlm::kernels::to_string(type)).c_str());
  std::printf(" %8s\n", "cuBLAS");
  for (const Shape& s : shapes) {
    // Our kernel per type and n (the weights of each type uploaded once per shape).
    std::vector<std::vector<double>> ours(std::size(tc_tokens),
                                          std::vector<double>(std::size(kTypes)));
    for (std::size_t ti = 0; ti < std::size(kTypes); ++ti) {
      const std::vector<unsigned char> host_bytes = random_weights(kTypes[ti], s, 4);
      batchlm::kernels::Matrix host;
      host.type = kTypes[ti];
      host.data = host_bytes.data();
      host.rows = s.rows;
      host.cols = s.cols;
      DevMem<unsigned char> dw(kc::device_bytes(host));
      const kc::DeviceMatrix w = kc::upload(host, dw.p);
      for (std::size_t ni = 0; ni < std::size(tc_tokens); ++ni) {
        const std::int64_t n = tc_tokens[ni];
        DevMem<float> dx(static_cast<std::size_t>(n * s.cols)),
            dy(static_cast<std::size_t>(n * s.rows));
        DevMem<unsigned char> scratch(kc::matmul_scratch_bytes(w, n));
        kc::check(cudaMemset(dx.p, 0, static_cast<std::size_t>(n * s.cols) * 4), "memset");
        const int k = 5;
        const double ms = time_graph(stream, k, opt.samples, [&] {
          for (int i = 0; i < k; ++i) kc::matmul(w, dx.p, n, dy.p, scratch.p, stream);
        });
        ours[ni][ti] = 2.0 * static_cast<double>(s.rows * s.cols * n) / (ms * 1e-3) / 1e12;
      }
    }
    // cuBLAS on F16 weights [rows][cols] and F16 x [n][cols]: column-major, y (rows x n, ld
    // rows) = W^T(as stored: cols x rows, ld cols)^T * X(cols x n, ld cols).
    DevMem<__half> wh(static_cast<std::size_t>(s.rows * s.cols));
    kc::check(cudaMemset(wh.p, 0, static_cast<std::size_t>(s.rows * s.cols) * 2), "memset");
    for (std::size_t ni = 0; ni < std::size(tc_tokens); ++ni) {
      const std::int64_t n = tc_tokens[ni];
      DevMem<__half> xh(static_cast<std::size_t>(n * s.cols));
      DevMem<float> dy(static_cast<std::size_t>(n * s.rows));
      kc::check(cudaMemset(xh.p, 0, static_cast<std::size_t>(n * s.cols) * 2), "memset");
      const float alpha = 1.0f, beta = 0.0f;
      auto gemm = [&] {
        check_cublas(
            cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.rows),
                         static_cast<int>(n), static_cast<int>(s.cols), &alpha, wh.p, CUDA_R_16F,
                         static_cast<int>(s.cols), xh.p, CUDA_R_16F, static_cast<int>(s.cols),
                         &beta, dy.p, CUDA_R_32F, static_cast<int>(s.rows), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "gemm");
      };
      gemm();  // outside the capture first: cuBLAS may set up its workspace
      kc::check(cudaStreamSynchronize(stream), "sync");
      const int k = 5;
      const double ms = time_graph(stream, k, opt.samples, [&] {
        for (int i = 0; i < k; ++i) gemm();
      });
      const double cublas_tflops =
          2.0 * static_cast<double>(s.rows * s.cols * n) / (ms * 1e-3) / 1e12;
      std::printf("%-12s %4lld", shape_name(s).c_str(), static_cast<long long>(n));
      for (std::size_t ti = 0; ti < std::size(kTypes); ++ti) std::printf(" %7.1f", ours[ni][ti]);
      std::printf(" %8.1f\n", cublas_tflops);
    }
  }

  // ---- --check: cuBLAS against our F16 product (the same F16 inputs; both accumulate in F32).
  if (opt.check) {
    const Shape s = shapes.front();
    const std::int64_t n = 64;
    std::vector<float> wv = random_floats(static_cast<std::size_t>(s.rows * s.cols), 21);
    std::vector<float> xv = random_floats(static_cast<std::size_t>(n * s.cols), 22);
    std::vector<std::uint16_t> wbits(wv.size()), xbits(xv.size());
    for (std::size_t i = 0; i < wv.size(); ++i) wbits[i] = batchlm::kernels::fp32_to_fp16(wv[i]);
    for (std::size_t i = 0; i < xv.size(); ++i) {
      xbits[i] = batchlm::kernels::fp32_to_fp16(xv[i]);
      xv[i] = batchlm::kernels::fp16_to_fp32(xbits[i]);  // exact in F16: both see the same x
    }
    batchlm::kernels::Matrix host;
    host.type = DType::F16;
    host.data = wbits.data();
    host.rows = s.rows;
    host.cols = s.cols;
    DevMem<unsigned char> dw(kc::device_bytes(host));
    const kc::DeviceMatrix w = kc::upload(host, dw.p);
    DevMem<__half> wh(wbits.size());
    kc::check(cudaMemcpy(wh.p, wbits.data(), wbits.size() * 2, cudaMemcpyHostToDevice), "copy");
    DevMem<float> dx(xv.size()), y1(static_cast<std::size_t>(n * s.rows)),
        y2(static_cast<std::size_t>(n * s.rows));
    DevMem<__half> xh(xv.size());
    DevMem<unsigned char> scratch(kc::matmul_scratch_bytes(w, n));
    kc::check(cudaMemcpy(dx.p, xv.data(), xv.size() * 4, cudaMemcpyHostToDevice), "copy");
    kc::check(cudaMemcpy(xh.p, xbits.data(), xbits.size() * 2, cudaMemcpyHostToDevice), "copy");
    kc::matmul(w, dx.p, n, y1.p, scratch.p, stream);
    const float alpha = 1.0f, beta = 0.0f;
    check_cublas(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.rows),
                              static_cast<int>(n), static_cast<int>(s.cols), &alpha, wh.p,
                              CUDA_R_16F, static_cast<int>(s.cols), xh.p, CUDA_R_16F,
                              static_cast<int>(s.cols), &beta, y2.p, CUDA_R_32F,
                              static_cast<int>(s.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "gemm");
    kc::check(cudaStreamSynchronize(stream), "sync");
    std::vector<float> a(static_cast<std::size_t>(n * s.rows)), b(a.size());
    kc::check(cudaMemcpy(a.data(), y1.p, a.size() * 4, cudaMemcpyDeviceToHost), "copy");
    kc::check(cudaMemcpy(b.data(), y2.p, b.size() * 4, cudaMemcpyDeviceToHost), "copy");
    const double err = relative_error(a, b);
    const bool pass = err < 1e-4;
    ok = ok && pass;
    std::printf("\ncheck: our F16 tensor-core product vs cuBLAS (%s, n=64): %.2e %s\n",
                shape_name(s).c_str(), err, pass ? "ok" : "FAIL");
  }

  cublasDestroy(cublas);
  cudaStreamDestroy(stream);
  if (!ok) {
    std::printf("\nCHECK FAILED\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
