// The CUDA matrix products and embedding lookup (kernels/cuda/matmul.cu) against host
// references: a double-precision product of the dequantized weights (the exact result the
// kernels round), the same with x and the weights rounded to F16 (what the tensor-core path
// computes), and the CPU kernels (which quantize activations). Skipped where no GPU is present.
//
// Method: fresh random inputs per case (normal, seeded from the case), the output poisoned
// with NaN before every run (an unwritten element fails), relative L2 error
// ||y - ref|| / ||ref|| against stated bounds (NaN fails every bound):
//   matrix-vector path (n <= 8), F32 FMA against F32 x:      1e-5 against the exact product
//   tensor-core path (n > 8), x and weights rounded to F16:   2e-3 against the exact product,
//                                                              1e-4 against the F16-rounded one
//   either path against the CPU kernels::matmul (activations quantized to Q8 / F16): 2e-2
//     (over products of at least 8 outputs)
// get_rows is bit-exact against the host dequantization, with zeros for a bad id.
//
// The K types have 256-element blocks: their cases round each shape's cols up to a multiple of
// 256 (cols_for). Q6_K goes up as F16 (cuda.hpp): its references are its values rounded to F16,
// the matrix the device holds.

// Before gpu_test.hpp: its DeviceBuffer<T> calls cudaMalloc(T**, size), the template overload
// of the runtime's C++ API (cuda_runtime.h), which cuda.hpp (cuda_runtime_api.h) lacks.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/cuda.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "gguf_writer.hpp"
#include "gpu_test.hpp"

namespace batchlm::gpu_test {
namespace {

using kernels::DType;

constexpr double kMatvecBound = 1e-5;
constexpr double kTensorCoreBound = 2e-3;
constexpr double kTensorCoreF16Bound = 1e-4;
constexpr double kCpuBound = 2e-2;

const DType kTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                        DType::Q5_K, DType::Q6_K, DType::F16,  DType::BF16, DType::F32};

std::string type_name(DType t) { return std::string(kernels::to_string(t)); }

// cols rounded up to a whole number of the type's blocks.
std::int64_t cols_for(DType t, std::int64_t cols) {
  const std::int64_t b = kernels::block_size(t) > 32 ? kernels::block_size(t) : 32;
  return (cols + b - 1) / b * b;
}

// The layout upload gives a file type (cuda.hpp).
DType device_type_of(DType t) {
  switch (t) {
    case DType::Q5_0: return DType::Q8_0;
    case DType::Q5_1: return DType::Q5_K;
    case DType::Q6_K: return DType::F16;
    default: return t;
  }
}

// The values the device holds: the file's, rounded to F16 where the layout is F16.
std::vector<float> device_values(DType t, std::vector<float> v) {
  if (device_type_of(t) == DType::F16 && t != DType::F16)
    for (float& x : v) x = kernels::fp16_to_fp32(kernels::fp32_to_fp16(x));
  return v;
}

// A weight matrix: its GGUF bytes, their dequantized values, and the uploaded device copy.
struct Weights {
  DType type;
  std::int64_t rows, cols;
  std::vector<std::byte> bytes;
  std::vector<float> values;  // dequantized as the device holds them, rows x cols
  DeviceBuffer<unsigned char> device;
  kc::DeviceMatrix matrix;

  kernels::Matrix host() const {
    kernels::Matrix m;
    m.type = type;
    m.data = bytes.data();
    m.rows = rows;
    m.cols = cols;
    return m;
  }

  Weights(DType t, std::int64_t r, std::int64_t c, std::mt19937& rng)
      : type(t),
        rows(r),
        cols(c),
        bytes(testing::quantize(t, random_floats(static_cast<std::size_t>(r * c), rng, 0.5f))),
        values(device_values(t, testing::dequantize(t, bytes, r * c))),
        device(kc::device_bytes(host())),
        matrix(kc::upload(host(), device.get())) {}
};

// y[t * rows + r] = sum_k w[r][k] * x[t][k] in double; with `f16`, w and x rounded to F16 first.
std::vector<float> reference(const Weights& w, const std::vector<float>& x, std::int64_t n,
                             bool f16) {
  auto round = [f16](float v) {
    return f16 ? static_cast<double>(kernels::fp16_to_fp32(kernels::fp32_to_fp16(v)))
               : static_cast<double>(v);
  };
  std::vector<double> wd(w.values.size()), xd(x.size());
  for (std::size_t i = 0; i < wd.size(); ++i) wd[i] = round(w.values[i]);
  for (std::size_t i = 0; i < xd.size(); ++i) xd[i] = round(x[i]);
  std::vector<float> y(static_cast<std::size_t>(n * w.rows));
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t r = 0; r < w.rows; ++r) {
      double s = 0;
      const double* wr = wd.data() + r * w.cols;
      const double* xt = xd.data() + t * w.cols;
      for (std::int64_t k = 0; k < w.cols; ++k) s += wr[k] * xt[k];
      y[static_cast<std::size_t>(t * w.rows + r)] = static_cast<float>(s);
    }
  }
  return y;
}

std::vector<float> cpu_matmul(const Weights& w, const std::vector<float>& x, std::int64_t n) {
  static kernels::ThreadPool pool(4);
  const kernels::Matrix m = w.host();
  std::vector<std::byte> scratch(kernels::activation_bytes(m, n) + 64);
  std::vector<float> y(static_cast<std::size_t>(n * w.rows));
  kernels::matmul(m, x.data(), n, y.data(), scratch.data(), pool);
  return y;
}

// Runs the GPU product on a poisoned output and returns it.
std::vector<float> gpu_matmul(const Weights& w, const std::vector<float>& x, std::int64_t n,
                              cudaStream_t stream = nullptr) {
  DeviceBuffer<float> dx(x);
  DeviceBuffer<float> dy(static_cast<std::size_t>(n * w.rows));
  DeviceBuffer<unsigned char> scratch(kc::matmul_scratch_bytes(w.matrix, n));
  dy.poison();
  kc::matmul(w.matrix, dx.get(), n, dy.get(), scratch.get(), stream);
  sync();
  return dy.download();
}

// One product checked against every reference that applies. The case's seed is its shape.
void check_case(DType type, std::int64_t rows, std::int64_t cols_asked, std::int64_t n) {
  const std::int64_t cols = cols_for(type, cols_asked);
  SCOPED_TRACE(type_name(type) + " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
               " n=" + std::to_string(n));
  std::mt19937 rng(static_cast<std::uint32_t>(
      static_cast<std::uint32_t>(type) * 1000003u + static_cast<std::uint32_t>(rows) * 7919u +
      static_cast<std::uint32_t>(cols) * 131u + static_cast<std::uint32_t>(n)));
  const Weights w(type, rows, cols, rng);
  const std::vector<float> x = random_floats(static_cast<std::size_t>(n * cols), rng);
  const std::vector<float> y = gpu_matmul(w, x, n);

  const double exact = relative_error(y, reference(w, x, n, false));
  if (n <= kc::kMatvecMaxTokens) {
    EXPECT_LT(exact, kMatvecBound) << "matvec vs exact";
  } else {
    EXPECT_LT(exact, kTensorCoreBound) << "tensor cores vs exact";
    EXPECT_LT(relative_error(y, reference(w, x, n, true)), kTensorCoreF16Bound)
        << "tensor cores vs the F16-rounded product";
  }
  // The CPU quantizes activations (error relative to each dot product's terms, not to its
  // value): a single product near cancellation can exceed any fixed bound, so the comparison
  // is over products with at least 8 outputs.
  if (n * rows >= 8) {
    EXPECT_LT(relative_error(y, cpu_matmul(w, x, n)), kCpuBound) << "vs CPU kernels::matmul";
  }
}

class CudaMatmul : public ::testing::TestWithParam<DType> {};

// The brief's grid: every type x tokens x shapes.
TEST_P(CudaMatmul, MatchesReferencesOverShapesAndTokenCounts) {
  BATCHLM_REQUIRE_GPU();
  const std::int64_t tokens[] = {1, 2, 3, 5, 8, 9, 16, 33, 100};
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {1, 32}, {7, 64}, {64, 576}, {130, 1536}, {1000, 576}};
  for (const auto& [rows, cols] : shapes)
    for (const std::int64_t n : tokens) check_case(GetParam(), rows, cols, n);
}

// Every matrix-vector instantiation (one per token count), with rows that leave a warp's row
// group partly past the end (rows % 16 != 0) and rows shorter than a warp's chunk stride.
TEST_P(CudaMatmul, EveryMatvecTokenCount) {
  BATCHLM_REQUIRE_GPU();
  for (std::int64_t n = 1; n <= kc::kMatvecMaxTokens; ++n) {
    check_case(GetParam(), 37, 128, n);
    check_case(GetParam(), 5, 2048, n);
  }
}

// Partial tiles of the tensor-core kernel (128 rows x 64 tokens) on both sides, exact tiles,
// one token past a tile, long rows (many k steps), the largest batch the model uses, and
// k split over blocks (few tiles: the partial sums go through scratch), evenly and not.
TEST_P(CudaMatmul, TensorCoreTails) {
  BATCHLM_REQUIRE_GPU();
  check_case(GetParam(), 128, 64, 64);     // exact tiles
  check_case(GetParam(), 129, 96, 65);     // one row and one token past a tile
  check_case(GetParam(), 127, 32, 63);     // one short of a tile, a single k step
  check_case(GetParam(), 257, 2048, 130);  // 9 tiles, 8 splits of 8 steps
  check_case(GetParam(), 3, 4096, 17);     // 1 tile, 16 splits
  check_case(GetParam(), 64, 256, 512);
  check_case(GetParam(), 64, 1568, 20);  // 49 steps: 6 splits of 9, the last of 4
}

// Long rows on the matrix-vector path (up to the model's 8192).
TEST_P(CudaMatmul, LongRows) {
  BATCHLM_REQUIRE_GPU();
  check_case(GetParam(), 24, 8192, 1);
  check_case(GetParam(), 9, 8192, 4);
  check_case(GetParam(), 3, 4096, 8);
}

// Many rows: the grid's row blocks beyond the first few (and the row clamp of the last one).
TEST_P(CudaMatmul, ManyRows) {
  BATCHLM_REQUIRE_GPU();
  check_case(GetParam(), 5003, 64, 1);
  check_case(GetParam(), 5003, 64, 7);
  check_case(GetParam(), 5003, 64, 40);
}

// The calls are asynchronous kernel launches only: they can be captured in a graph on a
// non-blocking stream (a hidden sync, allocation or legacy-stream copy would break the
// capture), and replaying the graph gives the direct results, bit for bit.
TEST_P(CudaMatmul, CapturesInAGraph) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(99);
  const Weights w(GetParam(), 200, cols_for(GetParam(), 576), rng);
  for (const std::int64_t n : {std::int64_t{3}, std::int64_t{40}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<float> x = random_floats(static_cast<std::size_t>(n * w.cols), rng);
    const std::vector<float> direct = gpu_matmul(w, x, n);

    cudaStream_t stream = nullptr;
    kc::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dy(static_cast<std::size_t>(n * w.rows));
    DeviceBuffer<unsigned char> scratch(kc::matmul_scratch_bytes(w.matrix, n));
    DeviceBuffer<std::int32_t> ids(std::vector<std::int32_t>{5, 0, 199});
    DeviceBuffer<float> rows_out(static_cast<std::size_t>(3 * w.cols));
    dy.poison();
    rows_out.poison();
    // The copies and memsets above ran on the legacy stream, which a non-blocking stream does
    // not wait for.
    sync();

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    kc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    kc::matmul(w.matrix, dx.get(), n, dy.get(), scratch.get(), stream);
    kc::get_rows(w.matrix, ids.get(), 3, rows_out.get(), stream);
    kc::check(cudaStreamEndCapture(stream, &graph), "end capture");
    kc::check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    kc::check(cudaGraphLaunch(exec, stream), "launch");
    kc::check(cudaStreamSynchronize(stream), "sync");
    const std::vector<float> replayed = dy.download();
    const std::vector<float> rows = rows_out.download();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);

    ASSERT_EQ(replayed.size(), direct.size());
    EXPECT_EQ(0, std::memcmp(replayed.data(), direct.data(), direct.size() * sizeof(float)));
    for (std::int64_t j = 0; j < w.cols; ++j) {
      EXPECT_EQ(rows[static_cast<std::size_t>(j)],
                w.values[static_cast<std::size_t>(5 * w.cols + j)]);
      EXPECT_EQ(rows[static_cast<std::size_t>(2 * w.cols + j)],
                w.values[static_cast<std::size_t>(199 * w.cols + j)]);
    }
  }
}

// device_bytes is a multiple of 256 and exactly what upload writes: a poisoned buffer past
// device_bytes keeps its poison. The float types keep their GGUF bytes as they are.
TEST_P(CudaMatmul, UploadWritesExactlyDeviceBytes) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(7);
  for (const auto& [rows, cols_asked] :
       {std::pair<std::int64_t, std::int64_t>{1, 32}, {7, 64}, {33, 576}, {0, 64}}) {
    const std::int64_t cols = cols_for(GetParam(), cols_asked);
    SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
    const std::vector<std::byte> bytes =
        testing::quantize(GetParam(), random_floats(static_cast<std::size_t>(rows * cols), rng));
    kernels::Matrix m;
    m.type = GetParam();
    m.data = bytes.data();
    m.rows = rows;
    m.cols = cols;
    const std::size_t size = kc::device_bytes(m);
    EXPECT_EQ(size % 256, 0u);
    EXPECT_GE(size, kernels::row_bytes(m.type, cols) * static_cast<std::size_t>(rows));
    DeviceBuffer<unsigned char> device(size + 512);
    device.poison();
    const kc::DeviceMatrix dm = kc::upload(m, device.get());
    EXPECT_EQ(dm.data, device.get());
    EXPECT_EQ(dm.type, device_type_of(m.type));
    EXPECT_EQ(dm.rows, rows);
    EXPECT_EQ(dm.cols, cols);
    const std::vector<unsigned char> back = device.download();
    for (std::size_t i = size; i < back.size(); ++i) ASSERT_EQ(back[i], 0xff) << "byte " << i;
    // Every byte of the allocation is written: no 16-byte run of poison is left (no weight
    // data has one: 0xffff is a NaN scale / F16 / BF16, and 16 bytes of 0xff quants or F32
    // NaNs do not come out of the quantizer for normal random values).
    for (std::size_t i = 0; i + 16 <= size; ++i) {
      bool all = true;
      for (std::size_t j = i; j < i + 16; ++j) all = all && back[j] == 0xff;
      ASSERT_FALSE(all) << "unwritten run at byte " << i;
    }
    if (m.type == DType::F32 || m.type == DType::F16 || m.type == DType::BF16) {
      EXPECT_EQ(0, std::memcmp(back.data(), bytes.data(), bytes.size()));
    }
  }
}

TEST_P(CudaMatmul, GetRowsIsExactAndZeroesBadIds) {
  BATCHLM_REQUIRE_GPU();
  for (const auto& [rows, cols_asked] :
       {std::pair<std::int64_t, std::int64_t>{37, 96}, {3, 576}, {1, 32}, {300, 2048}}) {
    const std::int64_t cols = cols_for(GetParam(), cols_asked);
    SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
    std::mt19937 rng(static_cast<std::uint32_t>(rows * 31 + cols));
    const Weights w(GetParam(), rows, cols, rng);
    const std::int32_t r = static_cast<std::int32_t>(rows);
    constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
    constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
    const std::vector<std::int32_t> ids = {0, r - 1, r / 2, -1, r, 0, kMin, kMax, r - 1};
    const auto n = static_cast<std::int64_t>(ids.size());
    DeviceBuffer<std::int32_t> dids(ids);
    DeviceBuffer<float> out(static_cast<std::size_t>(n * cols));
    out.poison();
    kc::get_rows(w.matrix, dids.get(), n, out.get(), nullptr);
    sync();
    const std::vector<float> got = out.download();

    // The CPU get_rows for the valid ids, as a second reference.
    std::vector<std::int32_t> valid;
    for (const std::int32_t id : ids)
      if (id >= 0 && id < r) valid.push_back(id);
    std::vector<float> cpu(valid.size() * static_cast<std::size_t>(cols));
    kernels::get_rows(w.host(), valid, cpu.data());

    std::size_t v = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const bool ok = ids[i] >= 0 && ids[i] < r;
      for (std::int64_t j = 0; j < cols; ++j) {
        const float g = got[i * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)];
        const float want =
            ok ? w.values[static_cast<std::size_t>(ids[i]) * static_cast<std::size_t>(cols) +
                          static_cast<std::size_t>(j)]
               : 0.0f;
        std::uint32_t gb, wb;
        std::memcpy(&gb, &g, 4);
        std::memcpy(&wb, &want, 4);
        ASSERT_EQ(gb, wb) << "id index " << i << " (id " << ids[i] << ") col " << j << ": " << g
                          << " vs " << want;
        if (ok && device_type_of(GetParam()) != DType::F16) {
          ASSERT_EQ(g, cpu[v * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)]);
        }
      }
      if (ok) ++v;
    }
  }
}

// Zero tokens or rows launch nothing and write nothing; bad shapes and pointers are
// std::invalid_argument before anything runs.
TEST_P(CudaMatmul, EdgeCasesAndInvalidArguments) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(3);
  const Weights w(GetParam(), 16, cols_for(GetParam(), 64), rng);
  DeviceBuffer<float> x(static_cast<std::size_t>(w.cols * 16 + 4));
  DeviceBuffer<float> y(16 * 16);
  DeviceBuffer<unsigned char> scratch(kc::matmul_scratch_bytes(w.matrix, 16));
  y.poison();
  kc::matmul(w.matrix, x.get(), 0, y.get(), scratch.get(), nullptr);
  DeviceBuffer<std::int32_t> ids(std::vector<std::int32_t>{0});
  kc::get_rows(w.matrix, ids.get(), 0, y.get(), nullptr);
  sync();
  for (const float v : y.download()) EXPECT_TRUE(std::isnan(v));

  EXPECT_EQ(kc::matmul_scratch_bytes(w.matrix, kc::kMatvecMaxTokens), 0u);
  EXPECT_GE(kc::matmul_scratch_bytes(w.matrix, 9), 9u * static_cast<std::size_t>(w.cols) * 2u);
  EXPECT_EQ(kc::matmul_scratch_bytes(w.matrix, 9) % 256, 0u);

  // x not 16-byte aligned.
  EXPECT_THROW(kc::matmul(w.matrix, x.get() + 1, 1, y.get(), nullptr, nullptr),
               std::invalid_argument);
  // The tensor-core path without scratch.
  EXPECT_THROW(kc::matmul(w.matrix, x.get(), 16, y.get(), nullptr, nullptr), std::invalid_argument);
  // cols not a multiple of 32.
  kc::DeviceMatrix bad = w.matrix;
  bad.cols = 48;
  EXPECT_THROW(kc::matmul(bad, x.get(), 1, y.get(), nullptr, nullptr), std::invalid_argument);
  kernels::Matrix host = w.host();
  host.cols = 40;
  EXPECT_THROW((void)kc::device_bytes(host), std::invalid_argument);
  // Q8_1 is an activation type only.
  host = w.host();
  host.type = DType::Q8_1;
  EXPECT_THROW((void)kc::device_bytes(host), std::invalid_argument);
  sync();
}

INSTANTIATE_TEST_SUITE_P(Types, CudaMatmul, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return type_name(info.param);
                         });

}  // namespace
}  // namespace batchlm::gpu_test
