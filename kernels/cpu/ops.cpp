// kernels/ops.hpp on the CPU: the drivers that split work over the thread pool and call the
// inner loops of the SIMD path chosen at start-up.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "cpu_kernels.hpp"

namespace batchlm::kernels {

namespace {

const cpu::Kernels& kernels() {
  static const cpu::Kernels& chosen = [] () -> const cpu::Kernels& {
    const char* force = std::getenv("BATCHLM_CPU_SIMD");
    const bool portable = force != nullptr && std::string(force) == "portable";
    if (!portable) {
      if (const cpu::Kernels* avx2 = cpu::avx2_kernels()) return *avx2;
    }
    return cpu::portable_kernels();
  }();
  return chosen;
}

// The type activations are converted to before a dot product with weights of type t.
DType dot_type(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q8_0: return DType::Q8_0;
    case DType::Q4_1: return DType::Q8_1;
    case DType::F16: return DType::F16;
    case DType::BF16: return DType::BF16;
    case DType::F32: return DType::F32;
    case DType::Q8_1: break;
  }
  throw std::invalid_argument("matmul: weights of type " + std::string(to_string(t)) +
                              " are not supported");
}

cpu::TileFn tile_for(DType t) {
  const auto& k = kernels();
  switch (t) {
    case DType::Q4_0: return k.tile_q4_0;
    case DType::Q4_1: return k.tile_q4_1;
    case DType::Q8_0: return k.tile_q8_0;
    case DType::F16: return k.tile_f16;
    case DType::BF16: return k.tile_bf16;
    case DType::F32: return k.tile_f32;
    case DType::Q8_1: break;
  }
  throw std::invalid_argument("matmul: unsupported weight type");
}

void convert_row(DType to, const float* x, std::int64_t n, void* out) {
  switch (to) {
    case DType::Q8_0: kernels().quantize_q8_0(x, n, out); return;
    case DType::Q8_1: kernels().quantize_q8_1(x, n, out); return;
    case DType::F16: {
      auto* o = static_cast<std::uint16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) o[i] = fp32_to_fp16(x[i]);
      return;
    }
    case DType::BF16: {
      auto* o = static_cast<std::uint16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) o[i] = fp32_to_bf16(x[i]);
      return;
    }
    case DType::F32: std::memcpy(out, x, static_cast<std::size_t>(n) * sizeof(float)); return;
    default: throw std::invalid_argument("matmul: bad activation type");
  }
}

// Rounds a float to the nearest F16 value (what storing it as F16 would keep).
float round_f16(float x) { return fp16_to_fp32(fp32_to_fp16(x)); }

}  // namespace

const char* cpu_simd_name() { return kernels().name; }

std::size_t activation_bytes(const Matrix& w, std::int64_t n) {
  return row_bytes(dot_type(w.type), w.cols) * static_cast<std::size_t>(n);
}

void matmul(const Matrix& w, const float* x, std::int64_t n, float* y, void* scratch,
            ThreadPool& pool) {
  const DType xt = dot_type(w.type);
  const std::size_t x_row = row_bytes(xt, w.cols);
  const std::size_t w_row = row_bytes(w.type, w.cols);
  const std::int64_t n_blocks = w.cols / block_size(w.type);
  auto* xq = static_cast<std::uint8_t*>(scratch);
  if (n >= 8) {
    pool.parallel_for(n, 4, [&](std::int64_t b, std::int64_t e, int) {
      for (std::int64_t t = b; t < e; ++t) convert_row(xt, x + t * w.cols, w.cols, xq + t * x_row);
    });
  } else {
    for (std::int64_t t = 0; t < n; ++t) convert_row(xt, x + t * w.cols, w.cols, xq + t * x_row);
  }
  const cpu::TileFn tile = tile_for(w.type);
  const auto* wd = static_cast<const std::uint8_t*>(w.data);
  // Rows are split over threads in multiples of the tile height; each thread walks its rows a
  // tile at a time and, for each row tile, every token, so the weight tile stays in L1 while
  // the (smaller) quantized activations stream from L2.
  const std::int64_t row_tiles = (w.rows + cpu::kTileRows - 1) / cpu::kTileRows;
  pool.parallel_for(row_tiles, 4, [&](std::int64_t b, std::int64_t e, int) {
    for (std::int64_t rt = b; rt < e; ++rt) {
      const std::int64_t r0 = rt * cpu::kTileRows;
      const int nr = static_cast<int>(std::min<std::int64_t>(cpu::kTileRows, w.rows - r0));
      for (std::int64_t t0 = 0; t0 < n; t0 += cpu::kTileTokens) {
        const int nt = static_cast<int>(std::min<std::int64_t>(cpu::kTileTokens, n - t0));
        tile(wd + r0 * w_row, w_row, nr, xq + t0 * x_row, x_row, nt, n_blocks,
             y + t0 * w.rows + r0, w.rows);
      }
    }
  });
}

void get_rows(const Matrix& w, std::span<const std::int32_t> ids, float* out) {
  const std::size_t w_row = row_bytes(w.type, w.cols);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= w.rows) throw std::out_of_range("get_rows: row out of range");
    const auto* row = static_cast<const std::uint8_t*>(w.data) + ids[i] * w_row;
    float* o = out + static_cast<std::int64_t>(i) * w.cols;
    switch (w.type) {
      case DType::F32: std::memcpy(o, row, static_cast<std::size_t>(w.cols) * 4); break;
      case DType::F16:
        for (std::int64_t j = 0; j < w.cols; ++j)
          o[j] = fp16_to_fp32(reinterpret_cast<const std::uint16_t*>(row)[j]);
        break;
      case DType::BF16:
        for (std::int64_t j = 0; j < w.cols; ++j)
          o[j] = bf16_to_fp32(reinterpret_cast<const std::uint16_t*>(row)[j]);
        break;
      case DType::Q8_0: {
        const auto* b = reinterpret_cast<const BlockQ8_0*>(row);
        for (std::int64_t k = 0; k < w.cols / 32; ++k) {
          const float d = fp16_to_fp32(b[k].d);
          for (int j = 0; j < 32; ++j) o[k * 32 + j] = d * static_cast<float>(b[k].qs[j]);
        }
        break;
      }
      case DType::Q4_0: {
        const auto* b = reinterpret_cast<const BlockQ4_0*>(row);
        for (std::int64_t k = 0; k < w.cols / 32; ++k) {
          const float d = fp16_to_fp32(b[k].d);
          for (int j = 0; j < 16; ++j) {
            o[k * 32 + j] = d * static_cast<float>((b[k].qs[j] & 0x0f) - 8);
            o[k * 32 + j + 16] = d * static_cast<float>((b[k].qs[j] >> 4) - 8);
          }
        }
        break;
      }
      case DType::Q4_1: {
        const auto* b = reinterpret_cast<const BlockQ4_1*>(row);
        for (std::int64_t k = 0; k < w.cols / 32; ++k) {
          const float d = fp16_to_fp32(b[k].d);
          const float m = fp16_to_fp32(b[k].m);
          for (int j = 0; j < 16; ++j) {
            o[k * 32 + j] = d * static_cast<float>(b[k].qs[j] & 0x0f) + m;
            o[k * 32 + j + 16] = d * static_cast<float>(b[k].qs[j] >> 4) + m;
          }
        }
        break;
      }
      case DType::Q8_1: throw std::invalid_argument("get_rows: Q8_1 is not a weight type");
    }
  }
}

void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out) {
  for (std::int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * dim;
    float* o = out + t * dim;
    double sum = 0.0;
    for (std::int64_t i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (std::int64_t i = 0; i < dim; ++i) o[i] = xr[i] * scale * weight[i];
  }
}

void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
          std::int64_t rot_dim, const std::int32_t* positions, float base) {
  const float theta_scale = std::pow(base, -2.0f / static_cast<float>(rot_dim));
  std::vector<float> cos_sin(static_cast<std::size_t>(rot_dim));
  for (std::int64_t t = 0; t < n; ++t) {
    // The angle of pair i is pos * theta_scale^i, built up by repeated multiplication.
    float theta = static_cast<float>(positions[t]);
    for (std::int64_t i = 0; i < rot_dim; i += 2) {
      cos_sin[i] = std::cos(theta);
      cos_sin[i + 1] = std::sin(theta);
      theta *= theta_scale;
    }
    for (std::int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (std::int64_t i = 0; i < rot_dim; i += 2) {
        const float c = cos_sin[i], s = cos_sin[i + 1];
        const float a = v[i], b = v[i + 1];
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
      }
    }
  }
}

void swiglu(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add(float* x, const float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void store_f16(const float* x, std::int64_t n, std::int64_t width, std::uint16_t* out,
               std::int64_t out_stride) {
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t i = 0; i < width; ++i) out[t * out_stride + i] = fp32_to_fp16(x[t * width + i]);
}

void attention(const AttentionShape& s, const float* q, std::int64_t n,
               const std::int32_t* positions, const std::uint16_t* k, const std::uint16_t* v,
               float* out, ThreadPool& pool) {
  const auto& kern = kernels();
  const std::int64_t group = s.n_heads / s.n_kv_heads;
  pool.parallel_for(n * s.n_heads, 1, [&](std::int64_t b, std::int64_t e, int) {
    std::vector<float> qh(static_cast<std::size_t>(s.head_dim));
    std::vector<float> scores;
    for (std::int64_t item = b; item < e; ++item) {
      const std::int64_t t = item / s.n_heads;
      const std::int64_t h = item % s.n_heads;
      const std::int64_t kvh = h / group;
      const std::int64_t n_ctx = positions[t] + 1;
      const float* qsrc = q + (t * s.n_heads + h) * s.head_dim;
      for (std::int64_t i = 0; i < s.head_dim; ++i) qh[i] = round_f16(qsrc[i]);
      scores.resize(static_cast<std::size_t>(n_ctx));
      float max = -INFINITY;
      for (std::int64_t p = 0; p < n_ctx; ++p) {
        scores[p] = kern.dot_f16(qh.data(), k + p * s.kv_stride + kvh * s.head_dim, s.head_dim) *
                    s.scale;
        max = std::max(max, scores[p]);
      }
      double sum = 0.0;
      for (std::int64_t p = 0; p < n_ctx; ++p) {
        scores[p] = std::exp(scores[p] - max);
        sum += scores[p];
      }
      const float inv = static_cast<float>(1.0 / sum);
      float* o = out + (t * s.n_heads + h) * s.head_dim;
      std::fill(o, o + s.head_dim, 0.0f);
      for (std::int64_t p = 0; p < n_ctx; ++p) {
        kern.axpy_f16(round_f16(scores[p] * inv), v + p * s.kv_stride + kvh * s.head_dim, o,
                      s.head_dim);
      }
    }
  });
}

std::int64_t argmax(const float* x, std::int64_t n) {
  std::int64_t best = 0;
  for (std::int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

}  // namespace batchlm::kernels
