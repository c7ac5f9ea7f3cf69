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

void tile_q5_0(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ5_0, BlockQ8_0>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ5_0& a, const BlockQ8_0& b, float acc) {
                                      int s = 0;
                                      for (int e = 0; e < 32; ++e) s += (q5_quant(a.qs, a.qh, e) - 16) * b.qs[e];
                                      return std::fma(h2f(a.d) * h2f(b.d), static_cast<float>(s), acc);
                                    });
}

void tile_q5_1(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ5_1, BlockQ8_1>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ5_1& a, const BlockQ8_1& b, float acc) {
                                      int s = 0;
                                      for (int e = 0; e < 32; ++e) s += q5_quant(a.qs, a.qh, e) * b.qs[e];
                                      acc = std::fma(h2f(a.d) * h2f(b.d), static_cast<float>(s), acc);
                                      return std::fma(h2f(a.m), h2f(b.s), acc);
                                    });
}

// The K types against Q8_K activations, super-block by super-block: the integer sums of
// ktypes_dot (below) exactly, then acc = fma(d_w * d_x, isum, acc) and, for Q4_K / Q5_K,
// acc = fma(-(dmin_w * d_x), msum, acc), in super-block order. Every path's K tiles give these
// bits.
//   Q4_K / Q5_K: isum = sum over sub-blocks j of sc_j * (sum of q * x over its 32 elements),
//                msum = sum over j of m_j * (bsums[2j] + bsums[2j + 1]);
//   Q6_K:        isum = sum over sub-blocks j of sc_j * (sum of q * x over its 16 elements
//                - 32 * bsums[j]).
template <bool kFifthBit>
float q45k_block(const std::uint8_t* block, const BlockQ8_K& b, float acc) {
  const auto& h = *reinterpret_cast<const BlockQ4_K*>(block);
  const std::uint8_t* qh = kFifthBit ? reinterpret_cast<const BlockQ5_K*>(block)->qh : nullptr;
  const std::uint8_t* qs = kFifthBit ? reinterpret_cast<const BlockQ5_K*>(block)->qs : h.qs;
  std::int32_t isum = 0, msum = 0;
  for (int j = 0; j < 8; ++j) {
    std::int32_t sum = 0;
    for (int e = 32 * j; e < 32 * j + 32; ++e) sum += k45_quant(qs, qh, e) * b.qs[e];
    std::uint8_t sc, m;
    k_scale_min(h.scales, j, sc, m);
    isum += sc * sum;
    msum += m * (b.bsums[2 * j] + b.bsums[2 * j + 1]);
  }
  acc = std::fma(h2f(h.d) * b.d, static_cast<float>(isum), acc);
  return std::fma(-(h2f(h.dmin) * b.d), static_cast<float>(msum), acc);
}

float q6k_block(const BlockQ6_K& a, const BlockQ8_K& b, float acc) {
  std::int32_t sub[16] = {};
  for (int e = 0; e < 256; ++e) sub[e / 16] += q6k_quant(a.ql, a.qh, e) * b.qs[e];
  std::int32_t isum = 0;
  for (int j = 0; j < 16; ++j) isum += a.scales[j] * (sub[j] - 32 * b.bsums[j]);
  return std::fma(h2f(a.d) * b.d, static_cast<float>(isum), acc);
}

void tile_q4_k(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ4_K, BlockQ8_K>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ4_K& a, const BlockQ8_K& b, float acc) {
                                      return q45k_block<false>(reinterpret_cast<const std::uint8_t*>(&a), b, acc);
                                    });
}

void tile_q5_k(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ5_K, BlockQ8_K>(w, wrb, nr, x, xrb, nt, nb, y, ys,
                                    [](const BlockQ5_K& a, const BlockQ8_K& b, float acc) {
                                      return q45k_block<true>(reinterpret_cast<const std::uint8_t*>(&a), b, acc);
                                    });
}

void tile_q6_k(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
               std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {
  tile_blocks<BlockQ6_K, BlockQ8_K>(w, wrb, nr, x, xrb, nt, nb, y, ys, q6k_block);
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

// Q8_K of 256 values: d = max|x| / 127 in F32, q = x * (127 / max|x|) rounded half to even,
// and the sum of each 16 q.
void quantize_q8_k(const float* x, std::int64_t n, void* out) {
  auto* blocks = static_cast<BlockQ8_K*>(out);
  for (std::int64_t b = 0; b < n / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    float amax = 0.0f;
    for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    BlockQ8_K& blk = blocks[b];
    blk.d = amax / 127.0f;
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int j = 16 * g; j < 16 * g + 16; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * id));
        blk.qs[j] = static_cast<std::int8_t>(q);
        sum += q;
      }
      blk.bsums[g] = static_cast<std::int16_t>(sum);
    }
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
  static const Kernels k = [] {
    Kernels k{"portable",        2,                tile_q4_0,        tile_q4_1,
                         tile_q8_0,         tile_f16,         tile_bf16,
                         tile_f32,          nullptr,          nullptr,          nullptr,
                         quantize_q8<BlockQ8_0>, quantize_q8<BlockQ8_1>,
                         axpy_f16,          to_f16,
                         round_f16,         score_runs_generic, mix_rows_generic,
                         softmax_f16,       exp_f32};
    k.tile_q5_0 = tile_q5_0;
    k.tile_q5_1 = tile_q5_1;
    k.tile_q4_k = tile_q4_k;
    k.tile_q5_k = tile_q5_k;
    k.tile_q6_k = tile_q6_k;
    k.quantize_q8_k = quantize_q8_k;
    return k;
  }();
  return k;
}

}  // namespace batchlm::kernels::cpu
