// kernels/ops.hpp on the CPU: the drivers that split work over the thread pool and call the
// inner loops of the SIMD path chosen at start-up.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "cpu_kernels.hpp"

namespace batchlm::kernels {

namespace {

const cpu::Kernels& kernels() {
  static const cpu::Kernels& chosen = [] () -> const cpu::Kernels& {
    // BATCHLM_CPU_SIMD=portable|avx2|avx-vnni caps the path (for tests and comparisons).
    const char* env = std::getenv("BATCHLM_CPU_SIMD");
    const std::string force = env ? env : "";
    if (force == "portable") return cpu::portable_kernels();
    if (force != "avx2" && force != "avx-vnni") {
      if (const cpu::Kernels* wide = cpu::avx512_kernels()) return *wide;
    }
    if (force != "avx2") {
      if (const cpu::Kernels* vnni = cpu::avx_vnni_kernels()) return *vnni;
    }
    if (const cpu::Kernels* avx2 = cpu::avx2_kernels()) return *avx2;
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
    case DType::Q5_0: return DType::Q8_0;
    case DType::Q5_1: return DType::Q8_1;
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: return DType::Q8_K;
    case DType::F16: return DType::F16;
    case DType::BF16: return DType::BF16;
    case DType::F32: return DType::F32;
    case DType::Q8_1:
    case DType::Q8_K: break;
  }
  throw std::invalid_argument("matmul: weights of type " + std::string(to_string(t)) +
                              " are not supported");
}

cpu::TileFn tile_for(const cpu::Kernels& k, DType t) {
  switch (t) {
    case DType::Q4_0: return k.tile_q4_0;
    case DType::Q4_1: return k.tile_q4_1;
    case DType::Q8_0: return k.tile_q8_0;
    case DType::Q5_0: return k.tile_q5_0;
    case DType::Q5_1: return k.tile_q5_1;
    case DType::Q4_K: return k.tile_q4_k;
    case DType::Q5_K: return k.tile_q5_k;
    case DType::Q6_K: return k.tile_q6_k;
    case DType::F16: return k.tile_f16;
    case DType::BF16: return k.tile_bf16;
    case DType::F32: return k.tile_f32;
    case DType::Q8_1:
    case DType::Q8_K: break;
  }
  throw std::invalid_argument("matmul: unsupported weight type");
}

// nullptr where the kernels have no packed tile for t.
cpu::PackedTileFn packed_tile_for(const cpu::Kernels& k, DType t) {
  switch (t) {
    case DType::Q4_0: return k.packed_q4_0;
    case DType::Q4_1: return k.packed_q4_1;
    case DType::Q8_0:
    case DType::Q5_0: return k.packed_q8_0;  // packed as Q8_0 blocks (pack_weights)
    case DType::Q5_1: return k.packed_q5_1;
    case DType::Q4_K: return k.packed_q4_k;
    case DType::Q5_K: return k.packed_q5_k;
    case DType::Q6_K: return k.packed_q6_k;
    default: return nullptr;
  }
}

void convert_row(const cpu::Kernels& k, DType to, const float* x, std::int64_t n, void* out) {
  switch (to) {
    case DType::Q8_0: k.quantize_q8_0(x, n, out); return;
    case DType::Q8_1: k.quantize_q8_1(x, n, out); return;
    case DType::Q8_K: k.quantize_q8_k(x, n, out); return;
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

// Whether the packed tiles read block scales written beside the rows of dot type xt: those of
// Q8_K (the K types) read d and the bsums from the BlockQ8_K rows themselves.
bool has_scales(DType xt) { return xt == DType::Q8_0 || xt == DType::Q8_1; }

// The bytes of the packed tiles' block scales (cpu_kernels.hpp) for n rows of dot type xt.
std::size_t scales_bytes(DType xt, std::int64_t cols, std::int64_t n) {
  const auto blocks = static_cast<std::size_t>(cols / kQuantBlock * n);
  switch (xt) {
    case DType::Q8_0: return blocks * sizeof(cpu::ScalesQ8_0);
    case DType::Q8_1: return blocks * sizeof(cpu::ScalesQ8_1);
    default: return 0;
  }
}

// The block scales of converted row t of n, as the packed tiles read them (block-major).
void write_scales(DType xt, const std::uint8_t* row, std::int64_t n_blocks, std::int64_t t,
                  std::int64_t n, void* out) {
  if (xt == DType::Q8_1) {
    const auto* b = reinterpret_cast<const BlockQ8_1*>(row);
    auto* o = static_cast<cpu::ScalesQ8_1*>(out) + t;
    for (std::int64_t j = 0; j < n_blocks; ++j)
      o[j * n] = {fp16_to_fp32(b[j].d), fp16_to_fp32(b[j].s)};
    return;
  }
  const auto* b = reinterpret_cast<const BlockQ8_0*>(row);
  auto* o = static_cast<cpu::ScalesQ8_0*>(out) + t;
  for (std::int64_t j = 0; j < n_blocks; ++j) {
    std::int32_t sum = 0;
    for (const std::int8_t q : b[j].qs) sum += q;
    o[j * n] = {fp16_to_fp32(b[j].d), sum};
  }
}

}  // namespace

namespace cpu {

std::size_t packed_block_bytes(DType t) {
  switch (t) {
    case DType::Q4_0: return 16 + 128;
    case DType::Q4_1: return 32 + 128;
    case DType::Q8_0:
    case DType::Q5_0: return 16 + 256;
    case DType::Q5_1: return 32 + 256;
    case DType::Q4_K: return 32 + 128 + 1024;
    case DType::Q5_K: return 32 + 128 + 1024 + 256;
    case DType::Q6_K: return 16 + 128 + 1024 + 512;
    default: return 0;
  }
}

void matmul_group(const Kernels& k, std::span<const Matrix> w, const float* x, std::int64_t n,
                  std::span<float* const> y, void* scratch, ThreadPool& pool) {
  constexpr std::size_t kMax = 8;
  const std::int64_t kRowAtATimeTokens = k.tile_tokens;
  if (w.empty() || w.size() > kMax || y.size() != w.size()) {
    throw std::invalid_argument("matmul_group: 1 to 8 matrices, one output each");
  }
  const std::int64_t cols = w[0].cols;
  // x is converted once per distinct dot type (a slot), with the block scales when a packed
  // tile reads it.
  struct Slot {
    DType type;
    std::size_t row_bytes;
    bool scales;
    const std::uint8_t* rows;
    const void* scales_at;
  };
  Slot slots[kMax];
  std::size_t n_slots = 0, slot_of[kMax], w_row[kMax];
  std::int64_t n_blocks[kMax], tile_rows[kMax], first_tile[kMax + 1];
  TileFn tile[kMax];
  PackedTileFn packed[kMax];
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (w[i].cols != cols) throw std::invalid_argument("matmul_group: matrices differ in cols");
    const DType xt = dot_type(w[i].type);
    w_row[i] = row_bytes(w[i].type, cols);
    n_blocks[i] = cols / block_size(w[i].type);
    tile[i] = tile_for(k, w[i].type);
    packed[i] = w[i].packed ? packed_tile_for(k, w[i].type) : nullptr;
    tile_rows[i] = packed[i] ? kPackedTileRows : kTileRows;
    std::size_t s = 0;
    while (s < n_slots && slots[s].type != xt) ++s;
    if (s == n_slots) slots[n_slots++] = Slot{xt, row_bytes(xt, cols), false, nullptr, nullptr};
    slots[s].scales = slots[s].scales || (packed[i] != nullptr && has_scales(xt));
    slot_of[i] = s;
  }
  auto* free_scratch = static_cast<std::uint8_t*>(scratch);
  for (std::size_t s = 0; s < n_slots; ++s) {
    Slot& slot = slots[s];
    std::uint8_t* rows = free_scratch;
    free_scratch += slot.row_bytes * static_cast<std::size_t>(n);
    std::uint8_t* scales = slot.scales ? free_scratch : nullptr;
    if (slot.scales) free_scratch += scales_bytes(slot.type, cols, n);
    slot.rows = rows;
    slot.scales_at = scales;
    const std::int64_t blocks = cols / kQuantBlock;
    const auto convert = [&](std::int64_t b, std::int64_t e, int) {
      for (std::int64_t t = b; t < e; ++t) {
        convert_row(k, slot.type, x + t * cols, cols, rows + t * slot.row_bytes);
        if (scales) write_scales(slot.type, rows + t * slot.row_bytes, blocks, t, n, scales);
      }
    };
    if (n >= 8) {
      pool.parallel_for(n, 4, convert);
    } else {
      convert(0, n, 0);
    }
  }
  first_tile[0] = 0;
  for (std::size_t i = 0; i < w.size(); ++i)
    first_tile[i + 1] = first_tile[i] + (w[i].rows + tile_rows[i] - 1) / tile_rows[i];
  const int tile_tokens = k.tile_tokens;
  // Row tiles of all matrices are one range over the threads; for each row tile every token,
  // so the weight tile stays in L1 while the (smaller) converted activations stream from L2.
  // The shares shrink down to single tiles, so the threads end within a tile of each other.
  pool.parallel_for(first_tile[w.size()], 1, [&](std::int64_t b, std::int64_t e, int) {
    std::size_t m = 0;
    for (std::int64_t t = b; t < e; ++t) {
      while (t >= first_tile[m + 1]) ++m;
      const Slot& slot = slots[slot_of[m]];
      const std::int64_t rows = w[m].rows;
      const std::int64_t r0 = (t - first_tile[m]) * tile_rows[m];
      const int nr = static_cast<int>(std::min<std::int64_t>(tile_rows[m], rows - r0));
      if (packed[m]) {
        // Each packed group is one sequential stream of weights, whatever the token count.
        const std::size_t group_bytes = static_cast<std::size_t>(n_blocks[m]) * packed_block_bytes(w[m].type);
        const auto* group = static_cast<const std::uint8_t*>(w[m].packed) + (r0 / kPackRows) * group_bytes;
        // The weights come from memory (the model is larger than the caches) and the hardware
        // does not fetch far enough ahead: the tile asks for the next one in this share as it
        // reads its own weights the first time, block by block.
        const std::int64_t share_end = std::min(e, first_tile[m + 1]);
        const std::uint8_t* ahead = t + 1 < share_end ? group + (kPackedTileRows / kPackRows) * group_bytes : nullptr;
        packed[m](group, nr, slot.rows, slot.row_bytes, slot.scales_at, static_cast<int>(n),
                  n_blocks[m], y[m] + r0, rows, ahead);
        continue;
      }
      const auto* wd = static_cast<const std::uint8_t*>(w[m].data) + r0 * w_row[m];
      if (n <= kRowAtATimeTokens) {
        // A few tokens (one decoding sequence, or a short speculative verify): read the weights
        // row after row, one sequential stream the hardware prefetcher follows (four
        // interleaved short streams stall on memory), each row against every token.
        for (int r = 0; r < nr; ++r)
          tile[m](wd + r * w_row[m], w_row[m], 1, slot.rows, slot.row_bytes, static_cast<int>(n),
                  n_blocks[m], y[m] + r0 + r, rows);
        continue;
      }
      for (std::int64_t t0 = 0; t0 < n; t0 += tile_tokens) {
        const int nt = static_cast<int>(std::min<std::int64_t>(tile_tokens, n - t0));
        tile[m](wd, w_row[m], nr, slot.rows + t0 * slot.row_bytes, slot.row_bytes, nt,
                n_blocks[m], y[m] + t0 * rows + r0, rows);
      }
    }
  });
}

}  // namespace cpu

const char* cpu_simd_name() { return kernels().name; }

std::size_t activation_bytes(const Matrix& w, std::int64_t n) {
  const DType xt = dot_type(w.type);
  return row_bytes(xt, w.cols) * static_cast<std::size_t>(n) +
         (w.packed ? scales_bytes(xt, w.cols, n) : 0);
}

void matmul(const Matrix& w, const float* x, std::int64_t n, float* y, void* scratch,
            ThreadPool& pool) {
  float* const ys[1] = {y};
  matmul_group(std::span<const Matrix>(&w, 1), x, n, ys, scratch, pool);
}

std::size_t group_activation_bytes(std::span<const Matrix> w, std::int64_t n) {
  // Per distinct dot type: the converted rows, and the block scales if a packed matrix reads it.
  std::size_t total = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const DType xt = dot_type(w[i].type);
    bool seen = false, packed = false;
    for (std::size_t j = 0; j < w.size(); ++j) {
      if (dot_type(w[j].type) != xt) continue;
      seen = seen || j < i;
      packed = packed || w[j].packed;
    }
    if (seen) continue;
    total += row_bytes(xt, w[i].cols) * static_cast<std::size_t>(n);
    if (packed) total += scales_bytes(xt, w[i].cols, n);
  }
  return total;
}

void matmul_group(std::span<const Matrix> w, const float* x, std::int64_t n,
                  std::span<float* const> y, void* scratch, ThreadPool& pool) {
  cpu::matmul_group(kernels(), w, x, n, y, scratch, pool);
}

namespace {

// Row r's super-block `in` of a K type into its group's packed block `out` (cpu_kernels.hpp):
// its d (and dmin), its integer scales (and mins) as bytes two sub-blocks to a row, the low 4
// bits of its quants as Q4_K's GGUF nibbles, and Q5_K's and Q6_K's high bits as their GGUF qh,
// in chunks of 4 bytes of each row.
void pack_k_block(DType t, const std::byte* in, int r, std::byte* out) {
  const auto put = [&](std::size_t at, std::uint8_t v) { out[at] = static_cast<std::byte>(v); };
  // n chunks from `at`: chunk c holds bytes 4c..4c+3 of `from` at 4r.
  const auto chunks = [&](std::size_t at, const void* from, int n) {
    for (int c = 0; c < n; ++c) std::memcpy(out + at + 32 * c + 4 * r, static_cast<const std::byte*>(from) + 4 * c, 4);
  };
  if (t == DType::Q6_K) {
    BlockQ6_K b;
    std::memcpy(&b, in, sizeof b);
    std::memcpy(out + 2 * r, &b.d, 2);
    for (int j = 0; j < 16; ++j) put(16 + 16 * (j / 2) + 2 * r + j % 2, static_cast<std::uint8_t>(b.scales[j]));
    // Q6_K's nibbles hold elements 64 apart; Q4_K's, which the tiles read, 32 apart.
    std::uint8_t nibbles[128];
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l)
        nibbles[32 * i + l] = static_cast<std::uint8_t>((q6k_quant(b.ql, b.qh, 64 * i + l) & 0x0f) |
                                                        (q6k_quant(b.ql, b.qh, 64 * i + 32 + l) & 0x0f) << 4);
    chunks(144, nibbles, 32);
    chunks(144 + 1024, b.qh, 16);
    return;
  }
  // Q4_K and Q5_K begin alike: d, dmin, the 12 bytes of scales and mins.
  std::memcpy(out + 2 * r, in, 2);
  std::memcpy(out + 16 + 2 * r, in + 2, 2);
  std::uint8_t scales[12];
  std::memcpy(scales, in + offsetof(BlockQ4_K, scales), sizeof scales);
  for (int j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    k_scale_min(scales, j, sc, m);
    put(32 + 16 * (j / 2) + 2 * r + j % 2, sc);
    put(96 + 16 * (j / 2) + 2 * r + j % 2, m);
  }
  if (t == DType::Q4_K) {
    chunks(160, in + offsetof(BlockQ4_K, qs), 32);
    return;
  }
  chunks(160, in + offsetof(BlockQ5_K, qs), 32);
  chunks(160 + 1024, in + offsetof(BlockQ5_K, qh), 8);
}

}  // namespace

void PackedWeights::Free::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t{64});
}

PackedWeights pack_weights(const Matrix& w) {
  PackedWeights p;
  const std::size_t block = cpu::packed_block_bytes(w.type);
  if (block == 0) return p;
  if (w.cols % block_size(w.type) != 0 || w.rows < 0) {
    throw std::invalid_argument("pack_weights: bad shape");
  }
  const std::int64_t n_blocks = w.cols / block_size(w.type);
  const std::int64_t groups = (w.rows + cpu::kPackRows - 1) / cpu::kPackRows;
  p.size_ = block * static_cast<std::size_t>(n_blocks * groups);
  // 64-byte aligned: every block of a group then starts 16-byte aligned and most of its
  // 32-byte chunks sit within one cache line.
  p.bytes_.reset(static_cast<std::byte*>(::operator new[](p.size_, std::align_val_t{64})));
  std::memset(p.bytes_.get(), 0, p.size_);
  // A GGUF block is F16 headers (d, and m for Q4_1) then the quants; the packed block holds the
  // 8 rows' headers field by field, then the quants in 4-byte pieces, chunk by chunk. A Q5_0
  // block d * (q - 16) is the Q8_0 block of d and the bytes q - 16, the same values, so it is
  // packed as that, and its products are Q8_0's: each block's exact integer sum, then one
  // multiply-add with d_w * d_x, the Q5_0 tiles' arithmetic.
  // A Q5_1 block keeps its d and m, and its quants become the bytes q.
  // The K types are laid out by pack_k_block.
  const bool q5_0 = w.type == DType::Q5_0, q5_1 = w.type == DType::Q5_1;
  const bool k_type = w.type == DType::Q4_K || w.type == DType::Q5_K || w.type == DType::Q6_K;
  const std::size_t headers = w.type == DType::Q4_1 || q5_1 ? 2 : 1;
  const std::size_t chunks = w.type == DType::Q8_0 || q5_0 || q5_1 ? 8 : 4;
  const std::size_t w_row = row_bytes(w.type, w.cols), w_block = block_bytes(w.type);
  for (std::int64_t g = 0; g < groups; ++g)
    for (std::int64_t b = 0; b < n_blocks; ++b) {
      std::byte* out = p.bytes_.get() + static_cast<std::size_t>(g * n_blocks + b) * block;
      for (std::int64_t r = 0; r < cpu::kPackRows && g * cpu::kPackRows + r < w.rows; ++r) {
        const auto* in = static_cast<const std::byte*>(w.data) +
                         static_cast<std::size_t>(g * cpu::kPackRows + r) * w_row +
                         static_cast<std::size_t>(b) * w_block;
        if (k_type) {
          pack_k_block(w.type, in, static_cast<int>(r), out);
          continue;
        }
        BlockQ8_1 as_bytes;  // Q5_1's d, m and bytes q: the layout the copies below read
        if (q5_1) {
          BlockQ5_1 b5;
          std::memcpy(&b5, in, sizeof b5);
          as_bytes.d = b5.d;
          as_bytes.s = b5.m;
          for (int e = 0; e < 32; ++e) as_bytes.qs[e] = static_cast<std::int8_t>(q5_quant(b5.qs, b5.qh, e));
          in = reinterpret_cast<const std::byte*>(&as_bytes);
        }
        BlockQ8_0 as_q8_0;
        if (q5_0) {
          BlockQ5_0 b5;
          std::memcpy(&b5, in, sizeof b5);
          as_q8_0.d = b5.d;
          for (int e = 0; e < 32; ++e) as_q8_0.qs[e] = static_cast<std::int8_t>(q5_quant(b5.qs, b5.qh, e) - 16);
          in = reinterpret_cast<const std::byte*>(&as_q8_0);
        }
        for (std::size_t h = 0; h < headers; ++h) std::memcpy(out + 16 * h + 2 * r, in + 2 * h, 2);
        for (std::size_t c = 0; c < chunks; ++c)
          std::memcpy(out + 16 * headers + 32 * c + 4 * r, in + 2 * headers + 4 * c, 4);
      }
    }
  return p;
}

void get_rows(const Matrix& w, std::span<const std::int32_t> ids, float* out) {
  const std::size_t w_row = row_bytes(w.type, w.cols);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= w.rows) throw std::out_of_range("get_rows: row out of range");
    dequantize_row(w.type, static_cast<const std::uint8_t*>(w.data) + ids[i] * w_row, w.cols,
                   out + static_cast<std::int64_t>(i) * w.cols);
  }
}

void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out) {
  for (std::int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * dim;
    float* o = out + t * dim;
    // The squares (exact in double) summed in eight interleaved partial sums, added pairwise at
    // the end: eight short chains of dependent additions in place of one long one.
    double part[8] = {};
    std::int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(xr[i + j]) * xr[i + j];
    double sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
    for (; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (i = 0; i < dim; ++i) o[i] = xr[i] * scale * weight[i];
  }
}

std::vector<float> rope_angles(std::int64_t n, std::int64_t rot_dim, const std::int32_t* positions, float base,
                               const float* freq_factors, float attn_factor, float freq_scale) {
  const float theta_scale = std::pow(base, -2.0f / static_cast<float>(rot_dim));
  std::vector<float> cos_sin(static_cast<std::size_t>(n * rot_dim));
  for (std::int64_t t = 0; t < n; ++t) {
    // The angle of pair i is pos * theta_scale^i, built up by repeated multiplication.
    float theta = static_cast<float>(positions[t]);
    float* cs = cos_sin.data() + t * rot_dim;
    for (std::int64_t i = 0; i < rot_dim; i += 2) {
      float angle = freq_factors != nullptr ? theta / freq_factors[i / 2] : theta;
      if (freq_scale != 1.0f) angle = freq_scale * angle;
      cs[i] = std::cos(angle);
      cs[i + 1] = std::sin(angle);
      if (attn_factor != 1.0f) {
        cs[i] *= attn_factor;
        cs[i + 1] *= attn_factor;
      }
      theta *= theta_scale;
    }
  }
  return cos_sin;
}

void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim, std::int64_t rot_dim,
          const float* cos_sin, RopeStyle style) {
  // Pair i is (v[i * step], v[i * step + other]).
  const std::int64_t step = style == RopeStyle::kAdjacent ? 2 : 1;
  const std::int64_t other = style == RopeStyle::kAdjacent ? 1 : rot_dim / 2;
  for (std::int64_t t = 0; t < n; ++t) {
    const float* cs = cos_sin + t * rot_dim;
    for (std::int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (std::int64_t i = 0; i < rot_dim / 2; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        float& a = v[i * step];
        float& b = v[i * step + other];
        const float a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = a0 * s + b0 * c;
      }
    }
  }
}

void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
          std::int64_t rot_dim, const std::int32_t* positions, float base) {
  rope(x, n, n_heads, head_dim, rot_dim, rope_angles(n, rot_dim, positions, base).data());
}

void swiglu(float* gate, const float* up, std::int64_t n) {
  const auto& kern = kernels();
  constexpr std::int64_t kBlock = 256;
  float neg[kBlock], e[kBlock];
  for (std::int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const std::int64_t m = std::min(kBlock, n - i0);
    for (std::int64_t i = 0; i < m; ++i) neg[i] = -gate[i0 + i];
    kern.exp_f32(neg, e, m);
    for (std::int64_t i = 0; i < m; ++i) gate[i0 + i] = gate[i0 + i] / (1.0f + e[i]) * up[i0 + i];
  }
}

void swiglu(float* gate, const float* up, std::int64_t n, ThreadPool& pool) {
  constexpr std::int64_t kSpan = 4096;
  pool.parallel_for((n + kSpan - 1) / kSpan, 1, [&](std::int64_t b, std::int64_t e, int) {
    swiglu(gate + b * kSpan, up + b * kSpan, std::min(n, e * kSpan) - b * kSpan);
  });
}

namespace {
// GELU's tanh form of every F16 input, rounded to F16 (the table llama.cpp's CPU backend looks
// its GELU up in).
const std::vector<std::uint16_t>& gelu_table() {
  static const std::vector<std::uint16_t> table = [] {
    std::vector<std::uint16_t> t(65536);
    constexpr float kCoef = 0.044715f, kSqrt2OverPi = 0.79788456080286535587989211986876f;
    for (std::size_t i = 0; i < t.size(); ++i) {
      const float x = fp16_to_fp32(static_cast<std::uint16_t>(i));
      t[i] = fp32_to_fp16(0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kCoef * x * x))));
    }
    return t;
  }();
  return table;
}
}  // namespace

void geglu(float* gate, const float* up, std::int64_t n, ThreadPool& pool) {
  const std::vector<std::uint16_t>& table = gelu_table();
  constexpr std::int64_t kSpan = 4096;
  pool.parallel_for((n + kSpan - 1) / kSpan, 1, [&](std::int64_t b, std::int64_t e, int) {
    const std::int64_t end = std::min(n, e * kSpan);
    for (std::int64_t i = b * kSpan; i < end; ++i) {
      const float x = gate[i];
      if (x <= -10.0f)
        gate[i] = 0.0f;
      else if (x >= 10.0f)
        gate[i] = x * up[i];
      else
        gate[i] = fp16_to_fp32(table[fp32_to_fp16(x)]) * up[i];
    }
  });
}

void softcap(float* x, std::int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (std::int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] * inv) * cap;
}

namespace {
// Rows of `dim` floats per share of a row-wise step: about 8 K floats, so a few rows stay on the
// calling thread.
std::int64_t row_grain(std::int64_t dim) { return std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(dim, 1)); }
}  // namespace

void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out, ThreadPool& pool) {
  pool.parallel_for(n, row_grain(dim),
                    [&](std::int64_t b, std::int64_t e, int) {
                      rms_norm(x + b * dim, weight, e - b, dim, eps, out + b * dim);
                    });
}

void add(float* x, const float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void add_rms_norm(float* x, const float* y, const float* weight, std::int64_t n, std::int64_t dim,
                  float eps, float* out, ThreadPool& pool) {
  pool.parallel_for(n, row_grain(dim),
                    [&](std::int64_t b, std::int64_t e, int) {
                      for (std::int64_t r = b; r < e; ++r) {
                        add(x + r * dim, y + r * dim, dim);
                        rms_norm(x + r * dim, weight, 1, dim, eps, out + r * dim);
                      }
                    });
}

void attention(const AttentionShape& s, const float* q, std::int64_t n,
               const std::int32_t* positions, const std::uint16_t* k, const std::uint16_t* v,
               float* out, ThreadPool& pool) {
  // One sequence whose cache is a single block holding every position; the keys in the paged
  // layout, transposed.
  const std::int32_t table[1] = {0};
  const std::span<const std::int32_t> tables[1] = {table};
  std::vector<std::int32_t> sequence_of(static_cast<std::size_t>(n), 0);
  std::int64_t n_ctx = 1;
  for (std::int64_t t = 0; t < n; ++t) n_ctx = std::max<std::int64_t>(n_ctx, positions[t] + 1);
  std::vector<std::uint16_t> keys(static_cast<std::size_t>(n_ctx * s.kv_stride));
  transpose_key_blocks(k, 1, n_ctx, s.kv_stride, keys.data());
  const PagedKv kv{keys.data(), v, n_ctx, tables, sequence_of.data()};
  attention_paged(s, q, n, positions, kv, out, pool);
}

void transpose_key_blocks(const std::uint16_t* rows, std::int64_t n_blocks, std::int64_t block_size,
                          std::int64_t width, std::uint16_t* out) {
  for (std::int64_t b = 0; b < n_blocks; ++b) {
    const std::uint16_t* src = rows + b * block_size * width;
    std::uint16_t* dst = out + b * block_size * width;
    for (std::int64_t j = 0; j < block_size; ++j)
      for (std::int64_t c = 0; c < width; ++c) dst[c * block_size + j] = src[j * width + c];
  }
}

namespace {

// Value row offsets in the pool of positions [from, to) of a sequence with this block table,
// for KV head kvh.
void gather_rows(const AttentionShape& s, const PagedKv& kv, std::span<const std::int32_t> table,
                 std::int64_t kvh, std::int64_t from, std::int64_t to, std::int64_t* rows) {
  // A block at a time: one table lookup per block, then consecutive slots.
  for (std::int64_t p = from; p < to;) {
    const std::int64_t slot = p % kv.block_size;
    const std::int64_t end = std::min(to, p - slot + kv.block_size);
    std::int64_t at = (table[p / kv.block_size] * kv.block_size + slot) * s.kv_stride + kvh * s.head_dim;
    for (; p < end; ++p, at += s.kv_stride) rows[p - from] = at;
  }
}

// The keys of the same positions as runs (cpu::KeyRun), appended to `runs`: up to
// kKeyRunSlots consecutive slots of a block each, their dimensions block_size apart.
void gather_key_runs(const AttentionShape& s, const PagedKv& kv, std::span<const std::int32_t> table,
                     std::int64_t kvh, std::int64_t from, std::int64_t to, std::vector<cpu::KeyRun>& runs) {
  for (std::int64_t p = from; p < to;) {
    const std::int64_t slot = p % kv.block_size;
    const std::int64_t n = std::min({to - p, kv.block_size - slot, cpu::kKeyRunSlots});
    runs.push_back({table[p / kv.block_size] * kv.block_size * s.kv_stride + kvh * s.head_dim * kv.block_size + slot, n});
    p += n;
  }
}

// The first position a query at position p sees.
std::int64_t window_start(const AttentionShape& s, std::int64_t p) {
  return s.window > 0 ? std::max<std::int64_t>(0, p - s.window + 1) : 0;
}

// Few tokens on many threads: one work item per query head, so that more threads pull the
// rows from memory, each KV head's rows once per query head.
void attention_per_head(const AttentionShape& s, const float* q, std::int64_t n,
                        const std::int32_t* positions, const PagedKv& kv, float* out,
                        ThreadPool& pool) {
  const auto& kern = kernels();
  const std::int64_t group = s.n_heads / s.n_kv_heads;
  pool.parallel_for(n * s.n_heads, 1, [&](std::int64_t b, std::int64_t e, int) {
    std::vector<float> qh(static_cast<std::size_t>(s.head_dim));
    std::vector<float> scores;
    std::vector<std::int64_t> rows;
    std::vector<cpu::KeyRun> runs;
    for (std::int64_t index = b; index < e; ++index) {
      // Latest tokens first: they see the most positions, so the longest items start first.
      const std::int64_t item = n * s.n_heads - 1 - index;
      const std::int64_t t = item / s.n_heads, h = item % s.n_heads;
      const std::int64_t lo = window_start(s, positions[t]), n_seen = positions[t] + 1 - lo;
      rows.resize(static_cast<std::size_t>(n_seen));
      gather_rows(s, kv, kv.block_tables[kv.sequence_of[t]], h / group, lo, lo + n_seen, rows.data());
      runs.clear();
      gather_key_runs(s, kv, kv.block_tables[kv.sequence_of[t]], h / group, lo, lo + n_seen, runs);
      const float* qsrc = q + (t * s.n_heads + h) * s.head_dim;
      qh.assign(qsrc, qsrc + s.head_dim);
      kern.round_f16(qh.data(), s.head_dim);
      scores.resize(static_cast<std::size_t>(n_seen));
      kern.score_runs(qh.data(), 1, kv.k_pool, runs.data(), static_cast<std::int64_t>(runs.size()), 0, s.head_dim,
                      kv.block_size, s.scale, scores.data(), n_seen);
      if (s.softcap != 0.0f) softcap(scores.data(), n_seen, s.softcap);
      kern.softmax_f16(scores.data(), n_seen, n_seen, 1);
      float* o = out + (t * s.n_heads + h) * s.head_dim;
      std::fill(o, o + s.head_dim, 0.0f);
      kern.mix_rows(scores.data(), 1, kv.v_pool, rows.data(), n_seen, 0, s.head_dim, o, n_seen);
    }
  });
}

}  // namespace

void attention_paged(const AttentionShape& s, const float* q, std::int64_t n,
                     const std::int32_t* positions, const PagedKv& kv, float* out,
                     ThreadPool& pool) {
  const std::int64_t threads = pool.size();
  // A token's attention streams its KV heads' rows from memory. Below, each (token, KV head)
  // item reads them once for all the query heads of the group; one item per query head reads
  // them once per query head, and pays only where the threads outnumber the (token, KV head)
  // items three to one. (Two threads, one sequence decoding, 3 KV heads over 1,600 positions:
  // 37 µs per layer against 64-76, `attention_cost --sequences 1 --prefix 1536 --tail 64`.)
  if (3 * n * s.n_kv_heads < threads) {
    attention_per_head(s, q, n, positions, kv, out, pool);
    return;
  }
  // Tokens whose sequences share their first cached blocks (a common prompt prefix through the
  // prefix cache, or several prompt tokens of one sequence) read those rows together: each key
  // and value row of the shared part is gathered once for all their query heads instead of once
  // per token. Every query's scores, softmax and sums are the same arithmetic in the same order
  // as alone, so the result does not depend on what else is in the batch.
  const auto table_of = [&](std::int64_t t) { return kv.block_tables[kv.sequence_of[t]]; };
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    const std::int32_t fa = table_of(a)[0], fb = table_of(b)[0];
    if (fa != fb) return fa < fb;
    if (kv.sequence_of[a] != kv.sequence_of[b]) return kv.sequence_of[a] < kv.sequence_of[b];
    return positions[a] < positions[b];
  });
  struct Item {
    std::int64_t begin, end;  // tokens order[begin, end)
    std::int64_t kvh;
    std::int64_t shared;  // positions [0, shared) are the same rows for all of them
  };
  // Every item reads and converts its shared rows, so items are few and large: per KV head,
  // about 2 * threads / n_kv_heads chunks (6 items for 3 KV heads and 2 threads, 3 apiece),
  // at most 16 tokens each.
  const std::int64_t per_head = std::max<std::int64_t>(1, (2 * threads + s.n_kv_heads - 1) / s.n_kv_heads);
  const std::int64_t chunk = std::clamp<std::int64_t>((n + per_head - 1) / per_head, 1, 16);
  std::vector<Item> items;
  for (std::int64_t begin = 0; begin < n;) {
    const std::int32_t first = table_of(order[begin])[0];
    std::int64_t end = begin + 1;
    while (end < n && table_of(order[end])[0] == first) ++end;
    // Split the run into chunks of tokens as even as can be (at most `chunk` each); each chunk
    // shares what all its tokens share.
    const std::int64_t n_chunks = (end - begin + chunk - 1) / chunk;
    for (std::int64_t c = 0; c < n_chunks; ++c) {
      const std::int64_t c0 = begin + (end - begin) * c / n_chunks;
      const std::int64_t c1 = begin + (end - begin) * (c + 1) / n_chunks;
      const std::span<const std::int32_t> lead = table_of(order[c0]);
      std::int64_t shared = std::numeric_limits<std::int64_t>::max();
      for (std::int64_t i = c0; i < c1; ++i) {
        const std::int64_t t = order[i];
        shared = std::min<std::int64_t>(shared, positions[t] + 1);
        const std::span<const std::int32_t> table = table_of(t);
        std::int64_t blocks = 0;
        while (blocks * kv.block_size < shared && table[blocks] == lead[blocks]) ++blocks;
        shared = std::min(shared, blocks * kv.block_size);
      }
      for (std::int64_t h = 0; h < s.n_kv_heads; ++h) items.push_back({c0, c1, h, shared});
    }
    begin = end;
  }

  const auto& kern = kernels();
  const std::int64_t group = s.n_heads / s.n_kv_heads, dim = s.head_dim;
  pool.parallel_for(static_cast<std::int64_t>(items.size()), 1, [&](std::int64_t b, std::int64_t e, int) {
    std::vector<float> qbuf, scores, obuf;
    std::vector<std::int64_t> shared_rows, tail_rows, tail_start, tail_run_start;
    std::vector<cpu::KeyRun> shared_runs, tail_runs;
    for (std::int64_t index = b; index < e; ++index) {
      const Item& it = items[index];
      const std::int64_t m = it.end - it.begin, n_q = m * group;
      // Scores are kept from `first`, the first position any of the tokens sees (0 but with a
      // sliding window); the shared rows are [first, shared_end), then each token's own.
      std::int64_t ld = 0, first = std::numeric_limits<std::int64_t>::max();
      for (std::int64_t i = 0; i < m; ++i) {
        const std::int64_t p = positions[order[it.begin + i]];
        ld = std::max<std::int64_t>(ld, p + 1);
        first = std::min(first, window_start(s, p));
      }
      const std::int64_t shared_end = std::max(first, it.shared);
      ld -= first;
      qbuf.resize(static_cast<std::size_t>(n_q * dim));
      for (std::int64_t i = 0; i < m; ++i) {
        const float* src = q + (order[it.begin + i] * s.n_heads + it.kvh * group) * dim;
        std::copy_n(src, group * dim, qbuf.data() + i * group * dim);
      }
      kern.round_f16(qbuf.data(), n_q * dim);
      shared_rows.resize(static_cast<std::size_t>(shared_end - first));
      gather_rows(s, kv, table_of(order[it.begin]), it.kvh, first, shared_end, shared_rows.data());
      shared_runs.clear();
      gather_key_runs(s, kv, table_of(order[it.begin]), it.kvh, first, shared_end, shared_runs);
      tail_start.assign(1, 0);
      tail_rows.clear();
      tail_run_start.assign(1, 0);
      tail_runs.clear();
      // A token's own rows start where the shared ones end, or where its window starts if later.
      const auto tail_from = [&](std::int64_t i) { return std::max(shared_end, window_start(s, positions[order[it.begin + i]])); };
      for (std::int64_t i = 0; i < m; ++i) {
        const std::int64_t t = order[it.begin + i], n_ctx = positions[t] + 1, from = tail_from(i);
        tail_rows.resize(static_cast<std::size_t>(tail_start.back() + n_ctx - from));
        gather_rows(s, kv, table_of(t), it.kvh, from, n_ctx, tail_rows.data() + tail_start.back());
        tail_start.push_back(static_cast<std::int64_t>(tail_rows.size()));
        gather_key_runs(s, kv, table_of(t), it.kvh, from, n_ctx, tail_runs);
        tail_run_start.push_back(static_cast<std::int64_t>(tail_runs.size()));
      }
      scores.resize(static_cast<std::size_t>(n_q * ld));
      // The shared keys, then each token's own, fetched ahead across the ends of the tokens' runs.
      kern.score_runs(qbuf.data(), static_cast<int>(n_q), kv.k_pool, shared_runs.data(),
                      static_cast<std::int64_t>(shared_runs.size()), 0, dim, kv.block_size, s.scale, scores.data(), ld);
      const auto n_tail_runs = static_cast<std::int64_t>(tail_runs.size());
      for (std::int64_t i = 0; i < m; ++i)
        kern.score_runs(qbuf.data() + i * group * dim, static_cast<int>(group), kv.k_pool,
                        tail_runs.data() + tail_run_start[i], tail_run_start[i + 1] - tail_run_start[i],
                        n_tail_runs - tail_run_start[i + 1], dim, kv.block_size, s.scale,
                        scores.data() + i * group * ld + (tail_from(i) - first), ld);
      for (std::int64_t i = 0; i < m; ++i) {
        // Each query's softmax over the positions it sees, as alone (the same values whatever
        // else the item holds); the positions before its window then weigh exactly 0.
        const std::int64_t p = positions[order[it.begin + i]], lo = window_start(s, p) - first;
        float* row = scores.data() + i * group * ld;
        if (s.softcap != 0.0f)
          for (std::int64_t g = 0; g < group; ++g) softcap(row + g * ld + lo, p + 1 - first - lo, s.softcap);
        kern.softmax_f16(row + lo, p + 1 - first - lo, ld, static_cast<int>(group));
        for (std::int64_t g = 0; g < group; ++g) std::fill(row + g * ld, row + g * ld + lo, 0.0f);
      }
      obuf.assign(static_cast<std::size_t>(n_q * dim), 0.0f);
      kern.mix_rows(scores.data(), static_cast<int>(n_q), kv.v_pool, shared_rows.data(), shared_end - first, 0, dim,
                    obuf.data(), ld);
      for (std::int64_t i = 0; i < m; ++i) {
        kern.mix_rows(scores.data() + i * group * ld + (tail_from(i) - first), static_cast<int>(group), kv.v_pool,
                      tail_rows.data() + tail_start[i], tail_start[i + 1] - tail_start[i],
                      tail_start[m] - tail_start[i + 1], dim,
                      obuf.data() + i * group * dim, ld);
        std::copy_n(obuf.data() + i * group * dim, group * dim,
                    out + (order[it.begin + i] * s.n_heads + it.kvh * group) * dim);
      }
    }
  });
}

void store_f16_paged(const float* x, std::int64_t n, std::int64_t width,
                     const std::int32_t* positions, const PagedKv& kv, std::uint16_t* pool) {
  for (std::int64_t t = 0; t < n; ++t) {
    const std::span<const std::int32_t> table = kv.block_tables[kv.sequence_of[t]];
    const std::int64_t p = positions[t];
    const std::int64_t block = table[p / kv.block_size];
    kernels().to_f16(x + t * width, pool + (block * kv.block_size + p % kv.block_size) * width,
                     width);
  }
}

void store_keys_paged(const float* x, std::int64_t n, std::int64_t width,
                      const std::int32_t* positions, const PagedKv& kv, std::uint16_t* pool) {
  std::vector<std::uint16_t> row(static_cast<std::size_t>(width));
  for (std::int64_t t = 0; t < n; ++t) {
    const std::span<const std::int32_t> table = kv.block_tables[kv.sequence_of[t]];
    const std::int64_t p = positions[t];
    std::uint16_t* at = pool + table[p / kv.block_size] * kv.block_size * width + p % kv.block_size;
    kernels().to_f16(x + t * width, row.data(), width);
    for (std::int64_t c = 0; c < width; ++c) at[c * kv.block_size] = row[c];
  }
}

void exp_f32(const float* x, float* out, std::int64_t n) { kernels().exp_f32(x, out, n); }

std::int64_t argmax(const float* x, std::int64_t n) {
  // The greatest value first, sixteen running maxima at a time (loops the compiler turns into
  // vector instructions), then the first position that holds it: the first of the greatest,
  // as a scan that keeps the first strictly greater value finds. NaNs are passed over (they
  // compare false), unless there is nothing else.
  constexpr std::int64_t kLanes = 16;
  if (n < 2 * kLanes) {
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < n; ++i)
      if (x[i] > x[best] || std::isnan(x[best])) best = i;
    return std::isnan(x[best]) ? 0 : best;
  }
  float lane[kLanes];
  for (std::int64_t j = 0; j < kLanes; ++j) lane[j] = -INFINITY;
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::int64_t j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  float best = -INFINITY;
  for (std::int64_t j = 0; j < kLanes; ++j) best = lane[j] > best ? lane[j] : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    bool hit = false;
    for (std::int64_t j = 0; j < kLanes; ++j) hit |= x[i + j] == best;
    if (hit) break;
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;  // every value NaN
}

}  // namespace batchlm::kernels
