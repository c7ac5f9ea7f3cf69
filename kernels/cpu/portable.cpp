// The portable inner loops: plain C++ the compiler may vectorise for the baseline ISA. They
// define the arithmetic that the SIMD versions must reproduce: the packed quantized tiles bit
// for bit, the other tiles up to summation order. This path reads the GGUF layout only
// (Matrix::packed is ignored here).

#include <algorithm>
#include <cmath>

#include "cpu_kernels.hpp"

namespace batchlm::kernels::cpu {

namespace {

float h2f(std::uint16_t h) { return fp16_to_fp32(h); }

// A quantized dot product, block by block: each block's integer dot product exactly, then
// acc = fma(d_w * d_x, dot, acc) (and for Q4_1 acc = fma(m_w, s_x, acc)) in block order, the
// arithmetic of one lane of the packed SIMD tiles. block_dot(w block, x block, acc) returns
// the new acc.
template <typename WBlock, typename XBlock, typename BlockDot>
void tile_blocks(const std::uint8_t* w, std::size_t w_row_bytes, int nr, const std::uint8_t* x,
                 std::size_t x_row_bytes, int nt, std::int64_t n_blocks, float* y,
                 std::int64_t y_stride, BlockDot block_dot) {
  for (int r = 0; r < nr; ++r) {
    const auto* wb = reinterpret_cast<const WBlock*>(w + r * w_row_bytes);
    for (int t = 0; t < nt; ++t) {
      const auto* xb = reinterpret_cast<const XBlock*>(x + t * x_row_bytes);
      float acc = 0.0f;
      for (std::int64_t b = 0; b < n_blocks; ++b) acc = block_dot(wb[b], xb[b], acc);
      y[t * y_stride + r] = acc;
    }
  }
}

void tile_q4_0(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ4_0, BlockQ8_0>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ4_0& a, const BlockQ8_0& b, float acc) {
                                      int s = 0;
                                      for (int j = 0; j < 16; ++j) {
                                        s += ((a.qs[j] & 0x0f) - 8) * b.qs[j];
                                        s += ((a.qs[j] >> 4) - 8) * b.qs[j + 16];
                                      }
                                      return std::fma(h2f(a.d) * h2f(b.d), static_cast<float>(s), acc);
                                    });
}

void tile_q4_1(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ4_1, BlockQ8_1>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ4_1& a, const BlockQ8_1& b, float acc) {
                                      int s = 0;
                                      for (int j = 0; j < 16; ++j) {
                                        s += (a.qs[j] & 0x0f) * b.qs[j];
                                        s += (a.qs[j] >> 4) * b.qs[j + 16];
                                      }
                                      acc = std::fma(h2f(a.d) * h2f(b.d), static_cast<float>(s), acc);
                                      return std::fma(h2f(a.m), h2f(b.s), acc);
                                    });
}

void tile_q8_0(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ8_0, BlockQ8_0>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ8_0& a, const BlockQ8_0& b, float acc) {
                                      int s = 0;
                                      for (int j = 0; j < 32; ++j) s += a.qs[j] * b.qs[j];
                                      return std::fma(h2f(a.d) * h2f(b.d), static_cast<float>(s), acc);
                                    });
}

template <typename T, typename Load>
void tile_elements(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
                   std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys,
                   Load load) {
  for (int r = 0; r < nr; ++r) {
    const auto* wr = reinterpret_cast<const T*>(w + r * wrb);
    for (int t = 0; t < nt; ++t) {
      const auto* xr = reinterpret_cast<const T*>(x + t * xrb);
      float sum = 0.0f;
      for (std::int64_t i = 0; i < n; ++i) sum += load(wr[i]) * load(xr[i]);
      y[t * ys + r] = sum;
    }
  }
}

void tile_f16(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
              std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys) {
  tile_elements<std::uint16_t>(w, wrb, nr, x, xrb, nt, n, y, ys, h2f);
}
void tile_bf16(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys) {
  tile_elements<std::uint16_t>(w, wrb, nr, x, xrb, nt, n, y, ys, bf16_to_fp32);
}
void tile_f32(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
              std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys) {
  tile_elements<float>(w, wrb, nr, x, xrb, nt, n, y, ys, [](float v) { return v; });
}

// Q8_0 / Q8_1 of one block: d = max|x| / 127, q = x * (127 / max|x|) rounded half to even.
template <typename Block>
void quantize_q8(const float* x, std::int64_t n, void* out) {
  auto* blocks = static_cast<Block*>(out);
  for (std::int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    Block& blk = blocks[b];
    blk.d = fp32_to_fp16(d);
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * id));
      blk.qs[j] = static_cast<std::int8_t>(q);
      sum += q;
    }
    if constexpr (requires { blk.s; }) blk.s = fp32_to_fp16(d * static_cast<float>(sum));
  }
}

void axpy_f16(float p, const std::uint16_t* v, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] += p * h2f(v[i]);
}

// The gathered-position attention loops on top of key_dot / axpy_f16 (any dim).
void score_runs_generic(const float* q, int n_q, const std::uint16_t* pool, const KeyRun* runs, std::int64_t n_runs,
                        std::int64_t /*n_after*/, std::int64_t dim, std::int64_t stride, float scale, float* scores, std::int64_t ld) {
  for (int j = 0; j < n_q; ++j) {
    std::int64_t r = 0;
    for (std::int64_t i = 0; i < n_runs; ++i)
      for (std::int64_t slot = 0; slot < runs[i].n; ++slot, ++r)
        scores[j * ld + r] = key_dot(q + j * dim, pool + runs[i].at + slot, dim, stride) * scale;
  }
}

void mix_rows_generic(const float* probs, int n_q, const std::uint16_t* pool, const std::int64_t* rows,
                      std::int64_t n_rows, std::int64_t /*n_after*/, std::int64_t dim, float* out, std::int64_t ld) {
  for (int j = 0; j < n_q; ++j)
    for (std::int64_t r = 0; r < n_rows; ++r) axpy_f16(probs[j * ld + r], pool + rows[r], out + j * dim, dim);
}

void softmax_f16_row(float* x, std::int64_t n) {
  float max = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) max = std::max(max, x[i]);
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (std::int64_t i = 0; i < n; ++i) x[i] = h2f(fp32_to_fp16(x[i] * inv));
}

void softmax_f16(float* x, std::int64_t n, std::int64_t ld, int rows) {
  for (int r = 0; r < rows; ++r) softmax_f16_row(x + r * ld, n);
}

void exp_f32(const float* x, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = std::exp(x[i]);
}

void to_f16(const float* x, std::uint16_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(x[i]);
}

void round_f16(float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = h2f(fp32_to_fp16(x[i]));
}

}  // namespace

const Kernels& portable_kernels() {
  static const Kernels k{"portable",        2,                tile_q4_0,        tile_q4_1,
                         tile_q8_0,         tile_f16,         tile_bf16,
                         tile_f32,          nullptr,          nullptr,          nullptr,
                         quantize_q8<BlockQ8_0>, quantize_q8<BlockQ8_1>,
                         axpy_f16,          to_f16,
                         round_f16,         score_runs_generic, mix_rows_generic,
                         softmax_f16,       exp_f32};
  return k;
}

}  // namespace batchlm::kernels::cpu
