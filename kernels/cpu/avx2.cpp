// The AVX2 + FMA + F16C inner loops. This file alone is compiled with those instructions
// enabled; ops.cpp calls into it only when the CPU reports all three. avx_vnni.cpp compiles
// it a second time with AVX-VNNI for the 8-bit dot products.

#include "cpu_kernels.hpp"

#if defined(BATCHLM_KERNELS_AVX512)
#define BATCHLM_KERNELS_ENTRY avx512_kernels
#define BATCHLM_KERNELS_NAME "avx512vl"
#define BATCHLM_KERNELS_TILE_TOKENS 4
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define BATCHLM_KERNELS_ENABLED 1
#endif
#elif defined(BATCHLM_KERNELS_VNNI)
#define BATCHLM_KERNELS_ENTRY avx_vnni_kernels
#define BATCHLM_KERNELS_NAME "avx-vnni"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define BATCHLM_KERNELS_ENABLED 1
#endif
#else
#define BATCHLM_KERNELS_ENTRY avx2_kernels
#define BATCHLM_KERNELS_NAME "avx2"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATCHLM_KERNELS_ENABLED 1
#endif
#endif

#if !defined(BATCHLM_KERNELS_TILE_TOKENS)
#define BATCHLM_KERNELS_TILE_TOKENS 2
#endif

// Tokens per pass of the packed tiles: an accumulator and an integer sum per token, held in
// registers (16 of them without AVX-512, 32 with).
#if defined(BATCHLM_KERNELS_AVX512)
#define BATCHLM_KERNELS_PACKED_TOKENS 8
#else
#define BATCHLM_KERNELS_PACKED_TOKENS 4
#endif

#if defined(BATCHLM_KERNELS_ENABLED)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace batchlm::kernels::cpu {

namespace {

inline float h2f(std::uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 4-bit values of a block as 32 bytes in element order: the low nibbles are elements 0..15,
// the high nibbles elements 16..31.
inline __m256i unpack_nibbles(const std::uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// Sum of products of 32 unsigned bytes u and 32 signed bytes s, as 8 float partial sums.
inline __m256 dot_us8(__m256i u, __m256i s) {
#if defined(BATCHLM_KERNELS_AVX512)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#elif defined(BATCHLM_KERNELS_VNNI)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s));
#else
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}
// The same for two signed operands: move the sign of a onto b, then multiply |a| by it.
inline __m256 dot_ss8(__m256i a, __m256i b) {
  return dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

#if defined(BATCHLM_KERNELS_AVX512)
// The per-block scale products of a tile, d_w[r] * d_x[t], and the Q4_1 minimum terms
// m_w[r] * s_x[t] are computed for all NR x NT pairs at once: lane r * NT + t of 8-lane vectors,
// from the blocks' F16 headers converted together. Each lane is the scalar product it replaces.
template <int NR, int NT>
struct TileHeaders {
  static constexpr int kPairs = NR * NT;
  static constexpr int kVectors = (kPairs + 7) / 8;
  __m256i w_first[kVectors], w_second[kVectors], x_first[kVectors], x_second[kVectors];
  TileHeaders() {
    for (int v = 0; v < kVectors; ++v) {
      alignas(32) std::int32_t wf[8], ws[8], xf[8], xs[8];
      for (int lane = 0; lane < 8; ++lane) {
        const int pair = std::min(v * 8 + lane, kPairs - 1), r = pair / NT, t = pair % NT;
        wf[lane] = 2 * r, ws[lane] = 2 * r + 1, xf[lane] = 2 * t, xs[lane] = 2 * t + 1;
      }
      w_first[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wf));
      w_second[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ws));
      x_first[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xf));
      x_second[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs));
    }
  }
};

// The first 4 bytes (two F16 values) of block b of up to 4 rows, as 8 floats [a0, b0, a1, b1...].
template <int N>
inline __m256 block_headers(const std::uint8_t* base, std::size_t row_bytes, std::size_t block_offset) {
  alignas(16) std::int32_t h[4] = {0, 0, 0, 0};
  for (int i = 0; i < N; ++i) std::memcpy(&h[i], base + i * row_bytes + block_offset, 4);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}
#endif

#if defined(BATCHLM_KERNELS_AVX512)
template <int NR, int NT>
void tile_q4_1_vec(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  using H = TileHeaders<NR, NT>;
  static const H idx;
  __m256 acc[NR][NT];
  __m256 mins[H::kVectors];
  alignas(32) float scale[H::kVectors * 8];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int v = 0; v < H::kVectors; ++v) mins[v] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    const __m256 wh = block_headers<NR>(w, wrb, b * sizeof(BlockQ4_1));  // d, m per row
    const __m256 xh = block_headers<NT>(x, xrb, b * sizeof(BlockQ8_1));  // d, s per token
    for (int v = 0; v < H::kVectors; ++v) {
      _mm256_store_ps(scale + v * 8, _mm256_mul_ps(_mm256_permutevar8x32_ps(wh, idx.w_first[v]),
                                                   _mm256_permutevar8x32_ps(xh, idx.x_first[v])));
      mins[v] = _mm256_add_ps(mins[v], _mm256_mul_ps(_mm256_permutevar8x32_ps(wh, idx.w_second[v]),
                                                     _mm256_permutevar8x32_ps(xh, idx.x_second[v])));
    }
    __m256i xq[NT];
    for (int t = 0; t < NT; ++t)
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>((reinterpret_cast<const BlockQ8_1*>(x + t * xrb) + b)->qs));
    for (int r = 0; r < NR; ++r) {
      const __m256i wq = unpack_nibbles((reinterpret_cast<const BlockQ4_1*>(w + r * wrb) + b)->qs);
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r * NT + t), dot_us8(wq, xq[t]), acc[r][t]);
    }
  }
  alignas(32) float m[H::kVectors * 8];
  for (int v = 0; v < H::kVectors; ++v) _mm256_store_ps(m + v * 8, mins[v]);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ys + r] = hsum(acc[r][t]) + m[r * NT + t];
}
#endif

template <int NR, int NT>
void tile_q4_1_scalar(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  __m256 acc[NR][NT];
  float mins[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      mins[r][t] = 0.0f;
    }
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i xq[NT];
    float xd[NT], xs[NT];
    for (int t = 0; t < NT; ++t) {
      const auto* xb = reinterpret_cast<const BlockQ8_1*>(x + t * xrb) + b;
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb->qs));
      xd[t] = h2f(xb->d);
      xs[t] = h2f(xb->s);
    }
    for (int r = 0; r < NR; ++r) {
      const auto* wb = reinterpret_cast<const BlockQ4_1*>(w + r * wrb) + b;
      const __m256i wq = unpack_nibbles(wb->qs);
      const float wd = h2f(wb->d), wm = h2f(wb->m);
      for (int t = 0; t < NT; ++t) {
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * xd[t]), dot_us8(wq, xq[t]), acc[r][t]);
        mins[r][t] += wm * xs[t];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ys + r] = hsum(acc[r][t]) + mins[r][t];
}

// The vector header form pays off for tiles of 8 pairs or more with 32 registers; with 16
// registers the header vectors spill, and small tiles (one token decoding, row by row) are
// faster in the scalar form (measured 4x on one-token decoding).
template <int NR, int NT>
void tile_q4_1_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
#if defined(BATCHLM_KERNELS_AVX512)
  if constexpr (NR * NT >= 8) {
    tile_q4_1_vec<NR, NT>(w, wrb, x, xrb, nb, y, ys);
    return;
  }
#endif
  tile_q4_1_scalar<NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

// Signed 8-bit weights against Q8_0 activations: `load` gives a weight block's 32 values as
// signed bytes (Q4_0: the nibbles minus 8; Q8_0: as stored).
template <typename WBlock, __m256i (*load)(const WBlock&), int NR, int NT>
void tile_signed_scalar(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x,
                        std::size_t xrb, std::int64_t nb, float* y, std::int64_t ys) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i xq[NT];
    float xd[NT];
    for (int t = 0; t < NT; ++t) {
      const auto* xb = reinterpret_cast<const BlockQ8_0*>(x + t * xrb) + b;
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb->qs));
      xd[t] = h2f(xb->d);
    }
    for (int r = 0; r < NR; ++r) {
      const WBlock& wb = reinterpret_cast<const WBlock*>(w + r * wrb)[b];
      const __m256i wq = load(wb);
      const float wd = h2f(wb.d);
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * xd[t]), dot_ss8(wq, xq[t]), acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ys + r] = hsum(acc[r][t]);
}

#if defined(BATCHLM_KERNELS_AVX512)
// The same with the scale products of all pairs at once (as tile_q4_1_vec).
template <typename WBlock, __m256i (*load)(const WBlock&), int NR, int NT>
void tile_signed_vec(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x,
                     std::size_t xrb, std::int64_t nb, float* y, std::int64_t ys) {
  using H = TileHeaders<NR, NT>;
  static const H idx;
  alignas(32) float scale[H::kVectors * 8];
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    // Lane 2i of each header vector is block b's scale of row (token) i.
    const __m256 wh = block_headers<NR>(w, wrb, b * sizeof(WBlock));
    const __m256 xh = block_headers<NT>(x, xrb, b * sizeof(BlockQ8_0));
    for (int v = 0; v < H::kVectors; ++v)
      _mm256_store_ps(scale + v * 8, _mm256_mul_ps(_mm256_permutevar8x32_ps(wh, idx.w_first[v]),
                                                   _mm256_permutevar8x32_ps(xh, idx.x_first[v])));
    __m256i xq[NT];
    for (int t = 0; t < NT; ++t)
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>((reinterpret_cast<const BlockQ8_0*>(x + t * xrb) + b)->qs));
    for (int r = 0; r < NR; ++r) {
      const __m256i wq = load(reinterpret_cast<const WBlock*>(w + r * wrb)[b]);
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r * NT + t), dot_ss8(wq, xq[t]), acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ys + r] = hsum(acc[r][t]);
}
#endif

template <typename WBlock, __m256i (*load)(const WBlock&), int NR, int NT>
void tile_signed_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x,
                   std::size_t xrb, std::int64_t nb, float* y, std::int64_t ys) {
#if defined(BATCHLM_KERNELS_AVX512)
  if constexpr (NR * NT >= 8) {  // as tile_q4_1_t
    tile_signed_vec<WBlock, load, NR, NT>(w, wrb, x, xrb, nb, y, ys);
    return;
  }
#endif
  tile_signed_scalar<WBlock, load, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

inline __m256i load_q4_0(const BlockQ4_0& b) {
  return _mm256_sub_epi8(unpack_nibbles(b.qs), _mm256_set1_epi8(8));
}
inline __m256i load_q8_0(const BlockQ8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}

template <int NR, int NT>
void tile_q4_0_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_signed_t<BlockQ4_0, load_q4_0, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

template <int NR, int NT>
void tile_q8_0_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_signed_t<BlockQ8_0, load_q8_0, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

// Packed matrices (the layout in cpu_kernels.hpp): lane r of a vector is row r of a group, so
// a block's products for all its rows and one token are integer dot products against 4
// activation bytes broadcast to every lane, and its scales take one multiply and one FMA per
// token for all the rows. Each lane does exactly the portable tile's arithmetic for its row.
//
// Rows8 holds one group in 256-bit vectors; with AVX-512, Rows16 holds two consecutive groups
// in 512-bit vectors (the second group's rows in the upper lanes): the same lane arithmetic
// with half the instructions (measured 1.8x faster on Zen 5, where 512-bit dot products issue
// as fast as 256-bit ones).
struct Rows8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;
  // The 32 bytes at p, and the 8 F16 values at p as floats; `group` is the distance to the
  // next group's, which Rows16 reads into its upper lanes.
  static I load(const std::uint8_t* p, std::size_t) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F load_f16(const std::uint8_t* p, std::size_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I bytes(char v) { return _mm256_set1_epi8(v); }
  static I dwords(std::int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I shift4(I a) { return _mm256_srli_epi16(a, 4); }
  // Each 16-bit half shifted left or right by n.
  static I shl16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I shr16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I shl(I a, int n) { return _mm256_slli_epi32(a, n); }
  // The low and the high 16 bits of each lane, sign-extended.
  static I low16(I a) { return _mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16); }
  static I high16(I a) { return _mm256_srai_epi32(a, 16); }
  // The 16 bytes at p widened to 16 bits (sign-extended when Signed).
  template <bool Signed>
  static I widen16(const std::uint8_t* p, std::size_t) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return Signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
  }
#if defined(BATCHLM_KERNELS_AVX512) || defined(BATCHLM_KERNELS_VNNI)
  // acc + the 4-byte dot products of unsigned u and signed s, per lane.
  static I dot(I acc, I u, I s) {
#if defined(BATCHLM_KERNELS_AVX512)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
  }
#endif
  static F fzero() { return _mm256_setzero_ps(); }
  static F floats(float v) { return _mm256_set1_ps(v); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* y, F v) { _mm256_storeu_ps(y, v); }
};

#if defined(BATCHLM_KERNELS_AVX512)
// The conversions and the insert are the zero-masking forms with every lane selected (the same
// instructions): GCC 12's unmasked forms pass an undefined vector that -Wmaybe-uninitialized
// reports.
struct Rows16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;
  static I load(const std::uint8_t* p, std::size_t group) {
    return _mm512_maskz_inserti64x4(0xff, _mm512_castsi256_si512(Rows8::load(p, 0)),
                                    Rows8::load(p + group, 0), 1);
  }
  static F load_f16(const std::uint8_t* p, std::size_t group) {
    return _mm512_maskz_cvtph_ps(0xffff, _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + group)), 1));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I bytes(char v) { return _mm512_set1_epi8(v); }
  static I dwords(std::int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I shift4(I a) { return _mm512_srli_epi16(a, 4); }
  static I shl16(I a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
  static I shr16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_maskz_mullo_epi32(0xffff, a, b); }
  static I madd16(I a, I b) { return _mm512_maskz_madd_epi16(0xffff, a, b); }
  static I shl(I a, int n) { return _mm512_maskz_slli_epi32(0xffff, a, static_cast<unsigned>(n)); }
  static I low16(I a) { return _mm512_maskz_srai_epi32(0xffff, shl(a, 16), 16); }
  static I high16(I a) { return _mm512_maskz_srai_epi32(0xffff, a, 16); }
  template <bool Signed>
  static I widen16(const std::uint8_t* p, std::size_t group) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + group)), 1);
    return Signed ? _mm512_maskz_cvtepi8_epi16(0xffffffff, v) : _mm512_maskz_cvtepu8_epi16(0xffffffff, v);
  }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F floats(float v) { return _mm512_set1_ps(v); }
  static F to_float(I a) { return _mm512_maskz_cvtepi32_ps(0xffff, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* y, F v) { _mm512_storeu_ps(y, v); }
};
#endif

#if defined(BATCHLM_KERNELS_AVX512)
// Zero-masking forms with every lane selected, as in Rows16.
inline __m512 cvtph16(__m256i h) { return _mm512_maskz_cvtph_ps(0xffff, h); }
inline __m256 half256(__m512 v, int upper) {
  return _mm256_castpd_ps(upper ? _mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(v), 1)
                                : _mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(v), 0));
}

#endif

#if defined(BATCHLM_KERNELS_AVX512) || defined(BATCHLM_KERNELS_VNNI)
constexpr bool kDotInstruction = true;
#else
constexpr bool kDotInstruction = false;
#endif

// The 4 activation bytes at p in every lane.
template <class V>
inline typename V::I broadcast4(const std::int8_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return V::dwords(v);
}

// Per-lane sums over one block of unsigned weight bytes times the broadcast activation bytes.
// With a dot-product instruction, one per vector. AVX2: the 16-bit pair sums of maddubs are
// added in 16 bits and widened once, exact for 4-bit weights (8 vectors x 2 products x 15 x 128
// < 2^15).
template <class V>
struct NibbleSum {
  typename V::I v = V::zero();
  void add(typename V::I u, typename V::I s) {
    if constexpr (kDotInstruction) {
      v = V::dot(v, u, s);
    } else {
      v = _mm256_add_epi16(v, _mm256_maddubs_epi16(u, s));
    }
  }
  typename V::I total() const {
    if constexpr (kDotInstruction) return v;
    else return _mm256_madd_epi16(v, _mm256_set1_epi16(1));
  }
};

// The same for signed weight bytes (Q8_0). With a dot-product instruction: the weights offset by
// 128 into unsigned bytes, and the offset, 128 times the activations' sum, taken off at the end.
// AVX2: |w| times x with w's sign, widened per vector (the 16-bit pairs reach 2 x 128 x 127).
template <class V>
struct ByteSum {
  struct Weights {
    typename V::I w, u;  // as stored; as the unsigned operand
    explicit Weights(typename V::I q) : w(q) {
      if constexpr (kDotInstruction) {
        u = V::xor_(q, V::bytes(-128));
      } else {
        u = _mm256_sign_epi8(q, q);
      }
    }
  };
  typename V::I v = V::zero();
  void add(const Weights& w, typename V::I s) {
    if constexpr (kDotInstruction) {
      v = V::dot(v, w.u, s);
    } else {
      const __m256i p16 = _mm256_maddubs_epi16(w.u, _mm256_sign_epi8(s, w.w));
      v = _mm256_add_epi32(v, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
    }
  }
  // The products of the signed weights; x_sum is the sum of the block's 32 activation bytes.
  typename V::I total(std::int32_t x_sum) const {
    if constexpr (kDotInstruction) return V::sub(v, V::dwords(128 * x_sum));
    else return v;
  }
};

// The same for unsigned weight bytes below 32 (Q5_1's). AVX2: widened per vector, as eight
// vectors of 16-bit pair sums could reach 8 x 2 x 31 x 128 > 2^15.
template <class V>
struct UByteSum {
  typename V::I v = V::zero();
  void add(typename V::I u, typename V::I s) {
    if constexpr (kDotInstruction) {
      v = V::dot(v, u, s);
    } else {
      v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    }
  }
  typename V::I total() const { return v; }
};

// Q5_1 is packed with Q4_1's headers (d and m) and Q8_0's 8 chunks of bytes, each weight's 5-bit
// q in a byte (pack_weights).
// The K types' blocks are super-blocks; their headers include the unpacked integer scales.
enum class PackedType { Q4_0, Q4_1, Q8_0, Q5_1, Q4_K, Q5_K, Q6_K };

template <PackedType F>
constexpr bool kKType = F == PackedType::Q4_K || F == PackedType::Q5_K || F == PackedType::Q6_K;
template <PackedType F>
constexpr bool kHasMin = F == PackedType::Q4_1 || F == PackedType::Q5_1;
template <PackedType F>
constexpr bool kByteChunks = F == PackedType::Q8_0 || F == PackedType::Q5_1;
template <PackedType F>
constexpr std::size_t kPackedHeaders = F == PackedType::Q6_K ? 144 : kKType<F> ? 160 : kHasMin<F> ? 32 : 16;
template <PackedType F>
constexpr std::size_t kPackedBlock = kPackedHeaders<F> + (F == PackedType::Q4_K ? 1024 : F == PackedType::Q5_K ? 1024 + 256 : F == PackedType::Q6_K ? 1024 + 512 : kByteChunks<F> ? 256 : 128);
template <PackedType F>
using PackedScales = std::conditional_t<kHasMin<F>, ScalesQ8_1, ScalesQ8_0>;

// The loops over tokens and chunks below must be unrolled for the sums and accumulators to
// live in registers (GCC keeps them in memory otherwise).
#define BATCHLM_UNROLL _Pragma("GCC unroll 16")

// The rows of V against NT tokens (w: the first group's first block, the next group `group`
// bytes further; x: the first token's row; scales: its first block's, the next block's
// `stride` further).
// Block b of the next tile's groups (`ahead`), a block at a time, while this one is worked on.
// Always inlined: a call in the loops below would spill their accumulators (every vector
// register is caller-saved).
template <PackedType F, class V>
[[gnu::always_inline]] inline void prefetch_block(const std::uint8_t* ahead, std::size_t group, std::int64_t b) {
  if (ahead == nullptr) return;
  for (int g = 0; g < V::kRows / kPackRows; ++g) {
    const std::uint8_t* p = ahead + g * group + b * kPackedBlock<F>;
    for (std::size_t at = 0; at < kPackedBlock<F>; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPackedBlock<F> - 1), _MM_HINT_T0);
  }
}

// The high bits of a chunk's quants, bits At.. of the bytes h (Bits of them: Q5_K's fifth bit,
// Q6_K's fifth and sixth), moved to bits 4.. of each byte: the 16-bit shift moves no bit across
// a byte into bits 4 and 5, which alone are kept.
template <class V, int Bits, int At>
inline typename V::I high_bits(typename V::I h) {
  if constexpr (At < 4) h = V::shl16(h, 4 - At);
  else if constexpr (At > 4) h = V::shr16(h, At - 4);
  return V::and_(h, V::bytes(Bits == 1 ? 0x10 : 0x30));
}

// isum[t] += sc * (the N chunks at q against the activation bytes at xq[t], 4 per chunk): one
// sub-block of a K type (Nibble: 1 the chunks' low nibbles, 2 their high ones; HighBits > 0:
// with that many high bits from bits HighAt.. of the chunks at high, 32 bytes apart like q's;
// weights at most kMaxQ). With a dot-product instruction the sub-block's sum is exact in 32
// bits, then multiplied by sc (the scale in each 32-bit lane). AVX2: the chunks' 16-bit pair
// sums added in 16 bits as many at a time as stay exact (each within 2 x kMaxQ x 128), then
// multiplied by sc (the scale in both 16-bit halves of each lane) and widened in one madd.
template <class V, int NT, int N, int Nibble, int kMaxQ, int HighBits = 0, int HighAt = 0>
inline void k_sub_block(const std::uint8_t* q, const std::uint8_t* high, std::size_t group,
                        const std::int8_t* const* xq, typename V::I sc, typename V::I (&isum)[NT]) {
  const auto chunk = [&](int c) {
    const typename V::I raw = V::load(q + 32 * c, group);
    const typename V::I low4 = V::and_(Nibble == 1 ? raw : V::shift4(raw), V::bytes(0x0f));
    if constexpr (HighBits == 0) return low4;
    else return V::or_(low4, high_bits<V, HighBits, HighAt>(V::load(high + 32 * c, group)));
  };
  if constexpr (kDotInstruction) {
    typename V::I sum[NT];
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) sum[t] = V::zero();
    BATCHLM_UNROLL
    for (int c = 0; c < N; ++c) {
      const typename V::I u = chunk(c);
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) sum[t] = V::dot(sum[t], u, broadcast4<V>(xq[t] + 4 * c));
    }
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) isum[t] = V::add(isum[t], V::mullo(sum[t], sc));
  } else {
    constexpr int kFit = std::min(N, 32767 / (2 * kMaxQ * 128));
    static_assert(N % kFit == 0);
    BATCHLM_UNROLL
    for (int c0 = 0; c0 < N; c0 += kFit) {
      __m256i sum[NT];
      BATCHLM_UNROLL
      for (int c = c0; c < c0 + kFit; ++c) {
        const __m256i u = chunk(c);
        BATCHLM_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i p = _mm256_maddubs_epi16(u, broadcast4<V>(xq[t] + 4 * c));
          sum[t] = c == c0 ? p : _mm256_add_epi16(sum[t], p);
        }
      }
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) isum[t] = V::add(isum[t], V::madd16(sum[t], sc));
    }
  }
}

// The scale of sub-block 2k + Odd of each lane from the 16-bit pairs P (k_sub_block's sc).
template <class V, int Odd>
inline typename V::I k_scale(typename V::I p) {
  if constexpr (kDotInstruction) {
    return Odd ? V::high16(p) : V::low16(p);
  } else {
    constexpr int kPick = Odd ? 0xf5 : 0xa0;  // 16-bit halves 1,1,3,3 or 0,0,2,2
    return _mm256_shufflelo_epi16(_mm256_shufflehi_epi16(p, kPick), kPick);
  }
}

// Elements 64K..64K+63 of a K type's super-block at blk: nibble chunks 8K..8K+7, their low
// nibbles then their high ones, against the activation bytes from 64K (xb), into isum; their
// scale pairs (Q6_K) or min pairs (Q4_K, Q5_K), widened, into pairs for the bsums. K is a
// template argument so that the high bits' shifts are immediates.
template <PackedType F, class V, int NT, int K>
[[gnu::always_inline]] inline void k_quarter(const std::uint8_t* blk, std::size_t group, const BlockQ8_K* const* xb,
                                             typename V::I* pairs, typename V::I (&isum)[NT]) {
  const std::uint8_t* q = blk + kPackedHeaders<F> + 256 * K;
  const std::uint8_t* high = F == PackedType::Q4_K ? nullptr : blk + kPackedHeaders<F> + 1024;
  const std::int8_t* xq[NT];
  BATCHLM_UNROLL
  for (int t = 0; t < NT; ++t) xq[t] = xb[t]->qs + 64 * K;
  const auto next = [&](int n) {
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) xq[t] += n;
  };
  if constexpr (F == PackedType::Q6_K) {
    // Sub-blocks of 16: 4K and 4K + 1 in the low nibbles of chunks 8K..8K+3 and 8K+4..8K+7
    // (scale pair 2K), 4K + 2 and 4K + 3 in their high nibbles (pair 2K + 1); their high bits
    // from chunks 8(K / 2).., bits 4(K % 2) for the low nibbles, two further for the high ones.
    constexpr int kAt = 4 * (K % 2);
    high += 256 * (K / 2);
    const typename V::I low_pair = V::template widen16<true>(blk + 16 + 32 * K, group);
    const typename V::I high_pair = V::template widen16<true>(blk + 32 + 32 * K, group);
    pairs[2 * K] = low_pair;
    pairs[2 * K + 1] = high_pair;
    k_sub_block<V, NT, 4, 1, 63, 2, kAt>(q, high, group, xq, k_scale<V, 0>(low_pair), isum);
    next(16);
    k_sub_block<V, NT, 4, 1, 63, 2, kAt>(q + 128, high + 128, group, xq, k_scale<V, 1>(low_pair), isum);
    next(16);
    k_sub_block<V, NT, 4, 2, 63, 2, kAt + 2>(q, high, group, xq, k_scale<V, 0>(high_pair), isum);
    next(16);
    k_sub_block<V, NT, 4, 2, 63, 2, kAt + 2>(q + 128, high + 128, group, xq, k_scale<V, 1>(high_pair), isum);
  } else {
    // Sub-block 2K in the low nibbles, 2K + 1 in the high ones; Q5_K's fifth bits bits 2K and
    // 2K + 1 of the 8 high chunks.
    constexpr int kFifth = F == PackedType::Q5_K ? 1 : 0;
    constexpr int kMaxQ = F == PackedType::Q5_K ? 31 : 15;
    const typename V::I pair = V::template widen16<false>(blk + 32 + 16 * K, group);
    pairs[K] = V::template widen16<false>(blk + 96 + 16 * K, group);
    k_sub_block<V, NT, 8, 1, kMaxQ, kFifth, 2 * K>(q, high, group, xq, k_scale<V, 0>(pair), isum);
    next(32);
    k_sub_block<V, NT, 8, 2, kMaxQ, kFifth, 2 * K + 1>(q, high, group, xq, k_scale<V, 1>(pair), isum);
  }
}

// The K types (layout in cpu_kernels.hpp) against Q8_K rows: per super-block and lane, isum as
// q45k_block / q6k_block (portable.cpp) sums it, exactly; the mins (Q4_K, Q5_K) or the -32
// offsets (Q6_K) against the bsums in 16-bit pairs, madd of the scale pairs and the bsum pairs;
// then the super-block's FMAs in portable order.
template <PackedType F, class V, int NT>
void packed_k_rows(const std::uint8_t* w, std::size_t group, const std::uint8_t* x, std::size_t xrb,
                   std::int64_t nb, typename V::F (&acc)[NT], const std::uint8_t* ahead) {
  constexpr bool kQ6 = F == PackedType::Q6_K;
  BATCHLM_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = V::fzero();
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::uint8_t* blk = w + b * kPackedBlock<F>;
    prefetch_block<F, V>(ahead, group, b);
    const BlockQ8_K* xb[NT];
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) xb[t] = reinterpret_cast<const BlockQ8_K*>(x + t * xrb) + b;
    typename V::I isum[NT];
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) isum[t] = V::zero();
    // The scale pairs (Q6_K) or min pairs (Q4_K, Q5_K) that meet the bsums, widened once.
    typename V::I pairs[kQ6 ? 8 : 4];
    k_quarter<F, V, NT, 0>(blk, group, xb, pairs, isum);
    k_quarter<F, V, NT, 1>(blk, group, xb, pairs, isum);
    k_quarter<F, V, NT, 2>(blk, group, xb, pairs, isum);
    k_quarter<F, V, NT, 3>(blk, group, xb, pairs, isum);
    const typename V::F d = V::load_f16(blk, group);
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) {
      const typename V::F dx = V::floats(xb[t]->d);
      if constexpr (kQ6) {
        // isum - 32 * sum of sc_j * bsums[j]: the pairs of bsums as they lie in the block.
        typename V::I offset = V::zero();
        for (int k = 0; k < 8; ++k)
          offset = V::add(offset, V::madd16(pairs[k], broadcast4<V>(reinterpret_cast<const std::int8_t*>(xb[t]->bsums + 2 * k))));
        acc[t] = V::fma(V::mul(d, dx), V::to_float(V::sub(isum[t], V::shl(offset, 5))), acc[t]);
      } else {
        // The bsums of the 8 sub-blocks of 32, in pairs.
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[t]->bsums));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[t]->bsums + 8));
        alignas(16) std::int8_t sums[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(sums), _mm_hadd_epi16(lo, hi));
        typename V::I msum = V::zero();
        for (int k = 0; k < 4; ++k)
          msum = V::add(msum, V::madd16(pairs[k], broadcast4<V>(sums + 4 * k)));
        acc[t] = V::fma(V::mul(d, dx), V::to_float(isum[t]), acc[t]);
        acc[t] = V::fnmadd(V::mul(V::load_f16(blk + 16, group), dx), V::to_float(msum), acc[t]);
      }
    }
  }
}

template <PackedType F, class V, int NT>
void packed_rows(const std::uint8_t* w, std::size_t group, const std::uint8_t* x,
                 std::size_t xrb, const PackedScales<F>* xs, std::int64_t stride,
                 std::int64_t nb, typename V::F (&acc)[NT], const std::uint8_t* ahead) {
  if constexpr (kKType<F>) {
    packed_k_rows<F, V, NT>(w, group, x, xrb, nb, acc, ahead);
    return;
  }
  using XBlock = std::conditional_t<kHasMin<F>, BlockQ8_1, BlockQ8_0>;
  BATCHLM_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = V::fzero();
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::uint8_t* blk = w + b * kPackedBlock<F>;
    const std::uint8_t* q = blk + kPackedHeaders<F>;
    prefetch_block<F, V>(ahead, group, b);
    const PackedScales<F>* xb = xs + b * stride;
    const std::int8_t* xq[NT];
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t) xq[t] = reinterpret_cast<const XBlock*>(x + t * xrb)[b].qs;
    typename V::I dot[NT];
    if constexpr (F == PackedType::Q8_0) {
      ByteSum<V> sum[NT];
      BATCHLM_UNROLL
      for (int c = 0; c < 8; ++c) {
        const typename ByteSum<V>::Weights wc(V::load(q + 32 * c, group));
        BATCHLM_UNROLL
        for (int t = 0; t < NT; ++t) sum[t].add(wc, broadcast4<V>(xq[t] + 4 * c));
      }
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) dot[t] = sum[t].total(xb[t].sum);
    } else if constexpr (F == PackedType::Q5_1) {
      UByteSum<V> sum[NT];
      BATCHLM_UNROLL
      for (int c = 0; c < 8; ++c) {
        const typename V::I wc = V::load(q + 32 * c, group);
        BATCHLM_UNROLL
        for (int t = 0; t < NT; ++t) sum[t].add(wc, broadcast4<V>(xq[t] + 4 * c));
      }
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) dot[t] = sum[t].total();
    } else {
      // Chunk c: the low nibbles pair with activation bytes 4c.., the high ones with 16+4c...
      const typename V::I mask = V::bytes(0x0f);
      NibbleSum<V> sum[NT];
      BATCHLM_UNROLL
      for (int c = 0; c < 4; ++c) {
        const typename V::I raw = V::load(q + 32 * c, group);
        const typename V::I lo = V::and_(raw, mask), hi = V::and_(V::shift4(raw), mask);
        BATCHLM_UNROLL
        for (int t = 0; t < NT; ++t) {
          sum[t].add(lo, broadcast4<V>(xq[t] + 4 * c));
          sum[t].add(hi, broadcast4<V>(xq[t] + 16 + 4 * c));
        }
      }
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) {
        dot[t] = sum[t].total();
        // Q4_0's weights are the nibbles minus 8.
        if constexpr (F == PackedType::Q4_0) dot[t] = V::sub(dot[t], V::dwords(8 * xb[t].sum));
      }
    }
    const typename V::F d = V::load_f16(blk, group);
    BATCHLM_UNROLL
    for (int t = 0; t < NT; ++t)
      acc[t] = V::fma(V::mul(d, V::floats(xb[t].d)), V::to_float(dot[t]), acc[t]);
    if constexpr (kHasMin<F>) {
      const typename V::F m = V::load_f16(blk + 16, group);
      BATCHLM_UNROLL
      for (int t = 0; t < NT; ++t) acc[t] = V::fma(m, V::floats(xb[t].s), acc[t]);
    }
  }
}

#undef BATCHLM_UNROLL

template <PackedType F, class V, int NT>
void packed_pass(const std::uint8_t* w, std::size_t group, int nr, const std::uint8_t* x,
                 std::size_t xrb, const PackedScales<F>* xs, std::int64_t stride,
                 std::int64_t nb, float* y, std::int64_t ys, const std::uint8_t* ahead) {
  typename V::F acc[NT];
  packed_rows<F, V, NT>(w, group, x, xrb, xs, stride, nb, acc, ahead);
  if (nr == V::kRows) {
    for (int t = 0; t < NT; ++t) V::store(y + t * ys, acc[t]);
    return;
  }
  alignas(64) float lanes[V::kRows];
  for (int t = 0; t < NT; ++t) {
    V::store(lanes, acc[t]);
    std::copy_n(lanes, nr, y + t * ys);
  }
}

// Rows r < nr <= V::kRows against all nt tokens, BATCHLM_KERNELS_PACKED_TOKENS at a time (the
// weights of the rows stay in L1).
template <PackedType F, class V>
void packed_tokens(const std::uint8_t* w, std::size_t group, int nr, const std::uint8_t* x,
                   std::size_t xrb, const PackedScales<F>* xs, int nt, std::int64_t nb, float* y,
                   std::int64_t ys, const std::uint8_t* ahead) {
  constexpr int kTokens = BATCHLM_KERNELS_PACKED_TOKENS;
  int t0 = 0;
  // The first pass reads the weights from memory and asks for the next tile's (`ahead`) as it
  // goes; the later passes find them in L1.
  for (; t0 + kTokens <= nt; t0 += kTokens)
    packed_pass<F, V, kTokens>(w, group, nr, x + t0 * xrb, xrb, kKType<F> ? xs : xs + t0, nt, nb,
                               y + t0 * ys, ys, t0 == 0 ? ahead : nullptr);
  const auto rest = [&]<int NT>() {
    packed_pass<F, V, NT>(w, group, nr, x + t0 * xrb, xrb, kKType<F> ? xs : xs + t0, nt, nb,
                          y + t0 * ys, ys, t0 == 0 ? ahead : nullptr);
  };
  switch (nt - t0) {
    case 0: break;
    case 1: rest.template operator()<1>(); break;
    case 2: rest.template operator()<2>(); break;
    case 3: rest.template operator()<3>(); break;
#if BATCHLM_KERNELS_PACKED_TOKENS == 8
    case 4: rest.template operator()<4>(); break;
    case 5: rest.template operator()<5>(); break;
    case 6: rest.template operator()<6>(); break;
    case 7: rest.template operator()<7>(); break;
#endif
    default: throw std::logic_error("packed_tile: token remainder");
  }
}

// Up to two groups: both at once in 512-bit vectors where there are two and AVX-512, else one
// after the other.
template <PackedType F>
void packed_tile(const std::uint8_t* w, int nr, const std::uint8_t* x, std::size_t xrb,
                 const void* scales, int nt, std::int64_t nb, float* y, std::int64_t ys,
                 const std::uint8_t* ahead) {
  const auto* xs = static_cast<const PackedScales<F>*>(scales);
  const std::size_t group = static_cast<std::size_t>(nb) * kPackedBlock<F>;
#if defined(BATCHLM_KERNELS_AVX512)
  if (nr > kPackRows) {
    packed_tokens<F, Rows16>(w, group, nr, x, xrb, xs, nt, nb, y, ys, ahead);
    return;
  }
#endif
  packed_tokens<F, Rows8>(w, group, std::min(nr, kPackRows), x, xrb, xs, nt, nb, y, ys, ahead);
  if (nr > kPackRows)
    packed_tokens<F, Rows8>(w + group, group, nr - kPackRows, x, xrb, xs, nt, nb,
                            y + kPackRows, ys, ahead != nullptr ? ahead + group : nullptr);
}

// Picks the instantiation for an nr x nt tile (nr <= 4, nt <= BATCHLM_KERNELS_TILE_TOKENS).
// With AVX-512VL the same 256-bit arithmetic has 32 registers, room for 4 tokens at a time.

#if BATCHLM_KERNELS_TILE_TOKENS == 4
#define BATCHLM_TILE_WIDE_CASES(impl)                                                        \
  case 1 * 8 + 3: impl<1, 3>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 1 * 8 + 4: impl<1, 4>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 2 * 8 + 3: impl<2, 3>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 2 * 8 + 4: impl<2, 4>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 3 * 8 + 3: impl<3, 3>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 3 * 8 + 4: impl<3, 4>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 4 * 8 + 3: impl<4, 3>(w, wrb, x, xrb, nb, y, ys); break;                              \
  case 4 * 8 + 4: impl<4, 4>(w, wrb, x, xrb, nb, y, ys); break;
#else
#define BATCHLM_TILE_WIDE_CASES(impl)
#endif

#define BATCHLM_TILE_FN(name, impl)                                                          \
  void name(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,           \
            std::size_t xrb, int nt, std::int64_t nb, float* y, std::int64_t ys) {           \
    switch (nr * 8 + nt) {                                                                   \
      case 1 * 8 + 1: impl<1, 1>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 1 * 8 + 2: impl<1, 2>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 2 * 8 + 1: impl<2, 1>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 2 * 8 + 2: impl<2, 2>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 3 * 8 + 1: impl<3, 1>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 3 * 8 + 2: impl<3, 2>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 4 * 8 + 1: impl<4, 1>(w, wrb, x, xrb, nb, y, ys); break;                          \
      case 4 * 8 + 2: impl<4, 2>(w, wrb, x, xrb, nb, y, ys); break;                          \
      BATCHLM_TILE_WIDE_CASES(impl)                                                          \
      default: throw std::invalid_argument("tile: unsupported shape");                       \
    }                                                                                        \
  }

// The 5-bit and K types bit for bit as portable.cpp: each block's integer sums exactly, in
// vectors of per-lane partial sums, one per (row, token) pair of the tile; then the partial sums
// are added across lanes so that pair p = r * NT + t lands in lane p % 8 of vector p / 8, where
// the block's float steps are done for up to 8 pairs at once, each lane in the portable order.

// The tiles' loops over rows, tokens and vectors are unrolled, for their sums to live in
// registers and lane_sums' counts to be constants.
#define BATCHLM_UNROLL_ALL _Pragma("GCC unroll 16")

// Lane i: the sum of the 8 lanes of v[i], for i < n <= 8 (lanes n.. are not used). n is a
// constant where the callers' loops are unrolled.
inline __m256i lane_sums(const __m256i* v, int n) {
  const auto at = [&](int i) { return i < n ? v[i] : _mm256_setzero_si256(); };
  const __m256i c0 = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)), _mm256_hadd_epi32(at(2), at(3)));
  if (n <= 4) {
    // Each 128-bit half holds the half sums of v[0..3] in order.
    return _mm256_add_epi32(c0, _mm256_permute2x128_si256(c0, c0, 0x01));
  } else {
    const __m256i c1 = _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)), _mm256_hadd_epi32(at(6), at(7)));
    return _mm256_add_epi32(_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
  }
}

// The pairs of an NR x NT tile: for vector v, each lane's row and token (lanes past the last
// pair repeat it).
template <int NR, int NT>
struct PairLanes {
  static constexpr int kPairs = NR * NT;
  static constexpr int kVectors = (kPairs + 7) / 8;
  __m256i row[kVectors], token[kVectors];
  PairLanes() {
    BATCHLM_UNROLL_ALL
    for (int v = 0; v < kVectors; ++v) {
      alignas(32) std::int32_t r[8], t[8];
      BATCHLM_UNROLL_ALL
      for (int lane = 0; lane < 8; ++lane) {
        const int p = std::min(8 * v + lane, kPairs - 1);
        r[lane] = p / NT, t[lane] = p % NT;
      }
      row[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(r));
      token[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
    }
  }
  // The lanes of each pair's row (token) in a vector whose entry for row (token) i is at
  // 2i + second.
  __m256i rows2(int v, int second) const {
    return _mm256_add_epi32(_mm256_slli_epi32(row[v], 1), _mm256_set1_epi32(second));
  }
  __m256i tokens2(int v, int second) const {
    return _mm256_add_epi32(_mm256_slli_epi32(token[v], 1), _mm256_set1_epi32(second));
  }
  // acc lane p to y[t * ys + r].
  static void store(const __m256 (&acc)[kVectors], float* y, std::int64_t ys) {
    alignas(32) float lanes[kVectors * 8];
    BATCHLM_UNROLL_ALL
    for (int v = 0; v < kVectors; ++v) _mm256_store_ps(lanes + 8 * v, acc[v]);
    BATCHLM_UNROLL_ALL
    for (int p = 0; p < kPairs; ++p) y[(p % NT) * ys + p / NT] = lanes[p];
  }
};

// The 4 bytes at p of each of N <= 4 rows `stride` apart, two F16 values each, as 8 floats
// [a0, b0, a1, b1, ...] (exact conversions).
template <int N>
inline __m256 f16_pairs(const std::uint8_t* p, std::size_t stride) {
  std::int32_t h[4] = {0, 0, 0, 0};
  for (int i = 0; i < N; ++i) std::memcpy(&h[i], p + i * stride, 4);
  return _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3]));
}

// acc + the sums of each 4 products of unsigned bytes u and signed bytes s, per 32-bit lane.
// AVX2: maddubs's 16-bit pair sums are exact for u < 64.
inline __m256i dot_u8(__m256i acc, __m256i u, __m256i s) {
#if defined(BATCHLM_KERNELS_AVX512)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(BATCHLM_KERNELS_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + the same 16-bit pair sums (exact for u < 64) times the 16-bit scales sc, per 32-bit lane.
inline __m256i dot_u8_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc) {
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
#if defined(BATCHLM_KERNELS_AVX512)
  return _mm256_dpwssd_epi32(acc, p16, sc);
#elif defined(BATCHLM_KERNELS_VNNI)
  return _mm256_dpwssd_avx_epi32(acc, p16, sc);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc));
#endif
}

// A Q5_0 / Q5_1 block's 32 values (0..31) as bytes in element order: byte j takes byte j / 8 of
// qh, and the fifth bit is set where its bit j % 8 is.
inline __m256i unpack_q5(const std::uint8_t* qs, const std::uint8_t* qh) {
  std::int32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(h), _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  return _mm256_or_si256(unpack_nibbles(qs), fifth);
}

// Q5_0 (Q5_1 with kMin) against Q8_0 (Q8_1). The unsigned 5-bit values are multiplied as they
// are; Q5_0's offset of 16 is taken off through the activations' sum, added once per token
// (as -16 x its 4-byte sums) to the start of each pair's sum.
template <bool kMin, int NR, int NT>
void tile_q5_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
               std::int64_t nb, float* y, std::int64_t ys) {
  using WBlock = std::conditional_t<kMin, BlockQ5_1, BlockQ5_0>;
  using XBlock = std::conditional_t<kMin, BlockQ8_1, BlockQ8_0>;
  using L = PairLanes<NR, NT>;
  static const L lanes;
  constexpr int V = L::kVectors;
  __m256i wd[V], xd[V];
  [[maybe_unused]] __m256i wm[V], xs[V];
  __m256 acc[V];
  BATCHLM_UNROLL_ALL
  for (int v = 0; v < V; ++v) {
    wd[v] = lanes.rows2(v, 0), wm[v] = lanes.rows2(v, 1);
    xd[v] = lanes.tokens2(v, 0), xs[v] = lanes.tokens2(v, 1);
    acc[v] = _mm256_setzero_ps();
  }
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i xq[NT], start[NT];
    BATCHLM_UNROLL_ALL
    for (int t = 0; t < NT; ++t) {
      const auto& xb = reinterpret_cast<const XBlock*>(x + t * xrb)[b];
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      if constexpr (kMin) {
        start[t] = _mm256_setzero_si256();
      } else {
        start[t] = _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8(_mm256_setzero_si256(), _mm256_set1_epi8(16), xq[t]));
      }
    }
    __m256i sums[NR * NT];
    BATCHLM_UNROLL_ALL
    for (int r = 0; r < NR; ++r) {
      const auto& wb = reinterpret_cast<const WBlock*>(w + r * wrb)[b];
      const __m256i wq = unpack_q5(wb.qs, wb.qh);
      BATCHLM_UNROLL_ALL
      for (int t = 0; t < NT; ++t) sums[r * NT + t] = dot_u8(start[t], wq, xq[t]);
    }
    const __m256 wh = f16_pairs<NR>(w + b * sizeof(WBlock), wrb);  // d (, m) of each row
    const __m256 xh = f16_pairs<NT>(x + b * sizeof(XBlock), xrb);  // d (, s) of each token
    BATCHLM_UNROLL_ALL
    for (int v = 0; v < V; ++v) {
      const __m256i s = lane_sums(sums + 8 * v, std::min(8, NR * NT - 8 * v));
      const __m256 d = _mm256_mul_ps(_mm256_permutevar8x32_ps(wh, wd[v]), _mm256_permutevar8x32_ps(xh, xd[v]));
      acc[v] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[v]);
      if constexpr (kMin)
        acc[v] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(wh, wm[v]), _mm256_permutevar8x32_ps(xh, xs[v]), acc[v]);
    }
  }
  L::store(acc, y, ys);
}

template <int NR, int NT>
void tile_q5_0_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_q5_t<false, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}
template <int NR, int NT>
void tile_q5_1_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_q5_t<true, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

// The 8 scales (low 8 bytes) and 8 mins (high 8 bytes) of a Q4_K / Q5_K block, k_scale_min
// four at a time: scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales
// (mins) 4-7 the low (high) nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 (4-7).
inline __m128i k_scales_mins(const std::uint8_t* q) {
  std::uint32_t a, b, c;
  std::memcpy(&a, q, 4);
  std::memcpy(&b, q + 4, 4);
  std::memcpy(&c, q + 8, 4);
  const std::uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
  const std::uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  const std::uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
  return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(m_lo),
                        static_cast<int>(m_hi));
}

// The 16-bit value at element j of every 128-bit half, in all 16 elements.
inline __m256i spread16(__m256i v, int j) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<short>(((2 * j + 1) << 8) | (2 * j))));
}

// Bit k of each byte of v as its bit 4 (16 or 0).
template <int K>
inline __m256i bit_as_16(__m256i v) {
  const __m256i moved = K >= 4 ? _mm256_srli_epi16(v, K - 4) : _mm256_slli_epi16(v, 4 - K);
  return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

enum class KType { Q4_K, Q5_K, Q6_K };

template <KType K, int I>
inline void k_chunk(const std::uint8_t* qs, __m256i qh, __m256i sc, const std::int8_t* const* xq,
                    __m256i* sums, int nt) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * I));
  __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  if constexpr (K == KType::Q5_K) {
    lo = _mm256_or_si256(lo, bit_as_16<2 * I>(qh));
    hi = _mm256_or_si256(hi, bit_as_16<2 * I + 1>(qh));
  }
  const __m256i sc_lo = spread16(sc, 2 * I), sc_hi = spread16(sc, 2 * I + 1);
  BATCHLM_UNROLL_ALL
  for (int t = 0; t < nt; ++t) {
    const std::int8_t* xb = xq[t] + 64 * I;
    sums[t] = dot_u8_scaled(sums[t], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)), sc_lo);
    sums[t] = dot_u8_scaled(sums[t], hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32)), sc_hi);
  }
}

// A K type against Q8_K. Per super-block and pair: isum with each 32-byte vector of products
// (one Q4_K / Q5_K sub-block; two Q6_K sub-blocks, one per 128-bit half) weighted by its
// scales in the 16-bit pair sums, and Q4_K / Q5_K's msum (Q6_K's -32 * sc_j * bsums[j], added to
// isum) from the activations' bsums times the 16-bit mins (scales), all in exact 32-bit sums.
template <KType K, int NR, int NT>
void tile_k_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
              std::int64_t nb, float* y, std::int64_t ys) {
  using WBlock = std::conditional_t<K == KType::Q4_K, BlockQ4_K, std::conditional_t<K == KType::Q5_K, BlockQ5_K, BlockQ6_K>>;
  constexpr bool kMins = K != KType::Q6_K;
  using L = PairLanes<NR, NT>;
  static const L lanes;
  constexpr int V = L::kVectors;
  constexpr int P = NR * NT;
  __m256i wd[V];
  [[maybe_unused]] __m256i wm[V];
  __m256 acc[V];
  BATCHLM_UNROLL_ALL
  for (int v = 0; v < V; ++v) {
    // Q4_K / Q5_K: d, dmin at the block's start; Q6_K: d, the second F16 value at byte 206.
    wd[v] = lanes.rows2(v, kMins ? 0 : 1), wm[v] = lanes.rows2(v, 1);
    acc[v] = _mm256_setzero_ps();
  }
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int8_t* xq[NT];
    __m256i bsums[NT];
    float xd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    BATCHLM_UNROLL_ALL
    for (int t = 0; t < NT; ++t) {
      const auto& xb = reinterpret_cast<const BlockQ8_K*>(x + t * xrb)[b];
      xq[t] = xb.qs;
      bsums[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
      xd[t] = xb.d;
    }
    __m256i isum[P];
    [[maybe_unused]] __m256i msum[P];
    BATCHLM_UNROLL_ALL
    for (int r = 0; r < NR; ++r) {
      const WBlock& wb = reinterpret_cast<const WBlock*>(w + r * wrb)[b];
      __m256i* is = isum + r * NT;
      if constexpr (kMins) {
        const __m128i scm = k_scales_mins(wb.scales);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
        const __m128i m = _mm_cvtepu8_epi16(_mm_srli_si128(scm, 8));
        // m_j next to itself, against bsums[2j] and bsums[2j + 1].
        const __m256i mins = _mm256_setr_m128i(_mm_unpacklo_epi16(m, m), _mm_unpackhi_epi16(m, m));
        BATCHLM_UNROLL_ALL
        for (int t = 0; t < NT; ++t) {
          msum[r * NT + t] = _mm256_madd_epi16(bsums[t], mins);
          is[t] = _mm256_setzero_si256();
        }
        __m256i qh = _mm256_setzero_si256();
        if constexpr (K == KType::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qh));
        const std::uint8_t* qs = wb.qs;
        k_chunk<K, 0>(qs, qh, sc, xq, is, NT);
        k_chunk<K, 1>(qs, qh, sc, xq, is, NT);
        k_chunk<K, 2>(qs, qh, sc, xq, is, NT);
        k_chunk<K, 3>(qs, qh, sc, xq, is, NT);
      } else {
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.scales));
        // -32 * sc_j (within 16 bits) against bsums[j].
        const __m256i neg32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5));
        BATCHLM_UNROLL_ALL
        for (int t = 0; t < NT; ++t) is[t] = _mm256_madd_epi16(bsums[t], neg32);
        const __m256i mask = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
        BATCHLM_UNROLL_ALL
        for (int h = 0; h < 2; ++h) {
          const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.ql + 64 * h));
          const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.ql + 64 * h + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qh + 32 * h));
          // Elements 128h + 32s + l, s = 0..3 (dtype.hpp).
          const __m256i q[4] = {
              _mm256_or_si256(_mm256_and_si256(ql0, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
              _mm256_or_si256(_mm256_and_si256(ql1, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask), _mm256_and_si256(qh, top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top))};
          BATCHLM_UNROLL_ALL
          for (int s = 0; s < 4; ++s) {
            // Sub-blocks 8h + 2s and 8h + 2s + 1: their scales in the two 128-bit halves.
            const int j = 8 * h + 2 * s;
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                sc8, _mm_set_epi64x(0x0101010101010101ll * (j + 1), 0x0101010101010101ll * j)));
            BATCHLM_UNROLL_ALL
            for (int t = 0; t < NT; ++t)
              is[t] = dot_u8_scaled(is[t], q[s], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + 128 * h + 32 * s)), sc);
          }
        }
      }
    }
    const std::size_t header = kMins ? 0 : offsetof(BlockQ6_K, d) - 2;
    const __m256 wh = f16_pairs<NR>(w + b * sizeof(WBlock) + header, wrb);
    const __m256 xdv = _mm256_setr_ps(xd[0], xd[1], xd[2], xd[3], 0.0f, 0.0f, 0.0f, 0.0f);
    BATCHLM_UNROLL_ALL
    for (int v = 0; v < V; ++v) {
      const __m256 dx = _mm256_permutevar8x32_ps(xdv, lanes.token[v]);
      const __m256i is = lane_sums(isum + 8 * v, std::min(8, P - 8 * v));
      acc[v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(wh, wd[v]), dx), _mm256_cvtepi32_ps(is), acc[v]);
      if constexpr (kMins) {
        const __m256i ms = lane_sums(msum + 8 * v, std::min(8, P - 8 * v));
        // fma(-(dmin * d_x), msum, acc)
        acc[v] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(wh, wm[v]), dx), _mm256_cvtepi32_ps(ms), acc[v]);
      }
    }
  }
  L::store(acc, y, ys);
}

template <int NR, int NT>
void tile_q4_k_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_k_t<KType::Q4_K, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}
template <int NR, int NT>
void tile_q5_k_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_k_t<KType::Q5_K, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}
template <int NR, int NT>
void tile_q6_k_t(const std::uint8_t* w, std::size_t wrb, const std::uint8_t* x, std::size_t xrb,
                 std::int64_t nb, float* y, std::int64_t ys) {
  tile_k_t<KType::Q6_K, NR, NT>(w, wrb, x, xrb, nb, y, ys);
}

#undef BATCHLM_UNROLL_ALL

BATCHLM_TILE_FN(tile_q4_1, tile_q4_1_t)
BATCHLM_TILE_FN(tile_q4_0, tile_q4_0_t)
BATCHLM_TILE_FN(tile_q8_0, tile_q8_0_t)
BATCHLM_TILE_FN(tile_q5_0, tile_q5_0_t)
BATCHLM_TILE_FN(tile_q5_1, tile_q5_1_t)
BATCHLM_TILE_FN(tile_q4_k, tile_q4_k_t)
BATCHLM_TILE_FN(tile_q5_k, tile_q5_k_t)
BATCHLM_TILE_FN(tile_q6_k, tile_q6_k_t)
#undef BATCHLM_TILE_FN
#undef BATCHLM_TILE_WIDE_CASES

void tile_f16(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
              std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys) {
  for (int r = 0; r < nr; ++r) {
    const auto* wr = reinterpret_cast<const std::uint16_t*>(w + r * wrb);
    for (int t = 0; t < nt; ++t) {
      const auto* xr = reinterpret_cast<const std::uint16_t*>(x + t * xrb);
      __m256 acc = _mm256_setzero_ps();
      std::int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
        const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + i)));
        acc = _mm256_fmadd_ps(a, b, acc);
      }
      float sum = hsum(acc);
      for (; i < n; ++i) sum += h2f(wr[i]) * h2f(xr[i]);
      y[t * ys + r] = sum;
    }
  }
}

void tile_f32(const std::uint8_t* w, std::size_t wrb, int nr, const std::uint8_t* x,
              std::size_t xrb, int nt, std::int64_t n, float* y, std::int64_t ys) {
  for (int r = 0; r < nr; ++r) {
    const auto* wr = reinterpret_cast<const float*>(w + r * wrb);
    for (int t = 0; t < nt; ++t) {
      const auto* xr = reinterpret_cast<const float*>(x + t * xrb);
      __m256 acc = _mm256_setzero_ps();
      std::int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i), _mm256_loadu_ps(xr + i), acc);
      float sum = hsum(acc);
      for (; i < n; ++i) sum += wr[i] * xr[i];
      y[t * ys + r] = sum;
    }
  }
}

inline float hmax(__m256 m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

inline std::int32_t hsum_i32(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}

// One block's header and bytes (qs: its 32 values in order, within [-127, 127]).
template <bool WithSum>
inline void store_q8_block(void* out, std::int64_t b, float d, std::int32_t sum, __m256i qs) {
  const std::uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);  // fp32_to_fp16(d)
  if constexpr (WithSum) {
    auto* blk = static_cast<BlockQ8_1*>(out) + b;
    blk->d = dh;
    blk->s = _cvtss_sh(d * static_cast<float>(sum), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk->qs), qs);
  } else {
    auto* blk = static_cast<BlockQ8_0*>(out) + b;
    blk->d = dh;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk->qs), qs);
  }
}

// As the portable version: d = max|x| / 127, q = round_half_even(x * 127 / max|x|).
template <bool WithSum>
void quantize_q8_t(const float* x, std::int64_t n, void* out) {
  for (std::int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
#if defined(BATCHLM_KERNELS_AVX512)
    // Sixteen lanes: the same maximum, scale, rounding and integer sum; vpmovdb narrows the
    // values to bytes in order (exact, as every value is within [-127, 127]).
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_maskz_max_ps(0xffff, _mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float max = hmax(_mm256_max_ps(half256(a, 0), half256(a, 1)));
    const __m512 id = _mm512_set1_ps(max != 0.0f ? 127.0f / max : 0.0f);
    const auto round = [&](__m512 v) {
      return _mm512_maskz_cvtps_epi32(0xffff, _mm512_maskz_roundscale_ps(0xffff, _mm512_mul_ps(v, id),
                                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    const __m512i q0 = round(v0), q1 = round(v1);
    const __m512 q = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
    const std::int32_t sum =
        WithSum ? hsum_i32(_mm256_add_epi32(_mm256_castps_si256(half256(q, 0)), _mm256_castps_si256(half256(q, 1)))) : 0;
    const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_maskz_cvtepi32_epi8(0xffff, q0)),
                                                  _mm512_maskz_cvtepi32_epi8(0xffff, q1), 1);
#else
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[j]));
    }
    const float max = hmax(amax);
    const __m256 id = _mm256_set1_ps(max != 0.0f ? 127.0f / max : 0.0f);
    __m256i qi[4];
    __m256i isum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      qi[j] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      isum = _mm256_add_epi32(isum, qi[j]);
    }
    const std::int32_t sum = WithSum ? hsum_i32(isum) : 0;
    // The 32 values (all within [-127, 127], so the saturating packs are exact) to bytes in
    // order: the packs interleave 128-bit lanes, the permutation puts them back.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
    store_q8_block<WithSum>(out, b, max / 127.0f, sum, bytes);
  }
}

// As the portable version: d = max|x| / 127 in F32, q = round_half_even(x * 127 / max|x|), and
// the sums of each 16 q, 32 values (two sums) at a time.
void quantize_q8_k(const float* x, std::int64_t n, void* out) {
  for (std::int64_t b = 0; b < n / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 256; j += 8)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + j)));
    const float max = hmax(amax);
    const __m256 id = _mm256_set1_ps(max != 0.0f ? 127.0f / max : 0.0f);
    auto& blk = static_cast<BlockQ8_K*>(out)[b];
    blk.d = max / 127.0f;
    __m256i sums[16];
    for (int c = 0; c < 8; ++c) {
      __m256i qi[4];
      for (int j = 0; j < 4; ++j)
        qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * c + 8 * j), id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sums[2 * c] = _mm256_add_epi32(qi[0], qi[1]);
      sums[2 * c + 1] = _mm256_add_epi32(qi[2], qi[3]);
      // To bytes in order, as quantize_q8_t.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs + 32 * c), bytes);
    }
    // packs interleaves the 128-bit halves of the two sum vectors; the permutation restores
    // the order (every sum is within [-2032, 2032]).
    const __m256i bsums = _mm256_permute4x64_epi64(_mm256_packs_epi32(lane_sums(sums, 8), lane_sums(sums + 8, 8)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.bsums), bsums);
  }
}

void axpy_f16(float p, const std::uint16_t* v, float* out, std::int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)));
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(out + i)));
  }
  for (; i < n; ++i) out[i] += p * h2f(v[i]);
}

// Value rows are scattered over the pool and, past a shared prefix, mostly in memory rather
// than cache, so each one is fetched kPrefetchRows rows ahead.
constexpr std::int64_t kPrefetchRows = 40;
inline void prefetch_row(const std::uint16_t* pool, std::int64_t row) {
  _mm_prefetch(reinterpret_cast<const char*>(pool + row), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(pool + row) + 64, _MM_HINT_T0);
}

// Key runs are fetched ahead of use, spread over the work on the runs before them: while the
// scores of runs [r, r + G) are taken, dimension by dimension, the same dimension of runs
// ahead[r .. r + G) is asked for (`ahead` is the caller's list further on, or null).

#if defined(BATCHLM_KERNELS_AVX512)
// The scores of NQ queries over every run, G runs at a time: a run's keys are the 16 lanes of
// one vector, dimension by dimension, so each query's score of each key is the multiply-add
// chain of key_dot in its own lane (the same bits), with no horizontal sums. Each vector of
// keys is converted from F16 once per pass and used by all NQ queries.
template <int NQ, int G, bool Full>
void score_tile(const float* q, std::int64_t dim, const std::uint16_t* const* base, const char* const* fetch,
                const __mmask16* mask, const std::int64_t* at, std::int64_t stride, __m512 vscale, float* scores,
                std::int64_t ld) {
  __m512 acc[NQ][G];
#pragma GCC unroll 8
  for (int u = 0; u < NQ; ++u)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (std::int64_t d = 0; d < dim; ++d) {
    __m512 k[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      if (fetch[g] != nullptr) _mm_prefetch(fetch[g] + 2 * d * stride, _MM_HINT_T0);
      const auto* p = reinterpret_cast<const __m256i*>(base[g] + d * stride);
      k[g] = Full ? cvtph16(_mm256_loadu_si256(p)) : _mm512_maskz_cvtph_ps(mask[g], _mm256_maskz_loadu_epi16(mask[g], p));
    }
#pragma GCC unroll 8
    for (int u = 0; u < NQ; ++u) {
      const __m512 qd = _mm512_set1_ps(q[u * dim + d]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[u][g] = _mm512_fmadd_ps(qd, k[g], acc[u][g]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < NQ; ++u)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + u * ld + at[g], mask[g], _mm512_mul_ps(acc[u][g], vscale));
}

template <int NQ, int G>
void score_pass(const float* q, std::int64_t dim, const std::uint16_t* pool, const KeyRun* runs,
                std::int64_t n_runs, std::int64_t stride, float scale, float* scores, std::int64_t ld,
                const KeyRun* ahead, std::int64_t n_ahead) {
  const __m512 vscale = _mm512_set1_ps(scale);
  std::int64_t out = 0;  // the first key of runs[r]
  for (std::int64_t r = 0; r < n_runs; r += G) {
    const std::uint16_t* base[G];
    const char* fetch[G];
    __mmask16 mask[G];
    std::int64_t at[G];
    bool full = true;
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const bool real = r + g < n_runs;  // past the last run: no lanes, nothing loaded or stored
      const KeyRun& run = runs[real ? r + g : r];
      base[g] = pool + run.at;
      mask[g] = real ? static_cast<__mmask16>((1u << run.n) - 1) : 0;
      at[g] = out;
      out += real ? run.n : 0;
      fetch[g] = ahead != nullptr && r + g < n_ahead ? reinterpret_cast<const char*>(pool + ahead[r + g].at) : nullptr;
      full = full && mask[g] == 0xffff;
    }
    if (full) {
      score_tile<NQ, G, true>(q, dim, base, fetch, mask, at, stride, vscale, scores, ld);
    } else {
      score_tile<NQ, G, false>(q, dim, base, fetch, mask, at, stride, vscale, scores, ld);
    }
  }
}
#else
// The same on eight lanes: each run of up to 16 keys is two vectors, each lane the chain of
// key_dot. A run shorter than 16 (the last of a sequence, or blocks smaller than 16) goes key
// by key through key_dot itself.
template <int NQ>
void score_pass(const float* q, std::int64_t dim, const std::uint16_t* pool, const KeyRun* runs,
                std::int64_t n_runs, std::int64_t stride, float scale, float* scores, std::int64_t ld,
                const KeyRun* ahead, std::int64_t n_ahead) {
  const __m256 vscale = _mm256_set1_ps(scale);
  std::int64_t out = 0;
  for (std::int64_t r = 0; r < n_runs; out += runs[r].n, ++r) {
    const std::uint16_t* base = pool + runs[r].at;
    const char* fetch = ahead != nullptr && r < n_ahead ? reinterpret_cast<const char*>(pool + ahead[r].at) : nullptr;
    if (runs[r].n < kKeyRunSlots) {
      for (int u = 0; u < NQ; ++u)
        for (std::int64_t slot = 0; slot < runs[r].n; ++slot)
          scores[u * ld + out + slot] = key_dot(q + u * dim, base + slot, dim, stride) * scale;
      continue;
    }
    __m256 acc[NQ][2];
    for (int u = 0; u < NQ; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < dim; ++d) {
      if (fetch != nullptr) _mm_prefetch(fetch + 2 * d * stride, _MM_HINT_T0);
      const auto* kd = reinterpret_cast<const __m128i*>(base + d * stride);
      const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128(kd)), k1 = _mm256_cvtph_ps(_mm_loadu_si128(kd + 1));
      for (int u = 0; u < NQ; ++u) {
        const __m256 qd = _mm256_set1_ps(q[u * dim + d]);
        acc[u][0] = _mm256_fmadd_ps(qd, k0, acc[u][0]);
        acc[u][1] = _mm256_fmadd_ps(qd, k1, acc[u][1]);
      }
    }
    for (int u = 0; u < NQ; ++u) {
      _mm256_storeu_ps(scores + u * ld + out, _mm256_mul_ps(acc[u][0], vscale));
      _mm256_storeu_ps(scores + u * ld + out + 8, _mm256_mul_ps(acc[u][1], vscale));
    }
  }
}
#endif

// Any head size. The runs go in chunks of kChunkRuns (256 keys, 32 KB of them at dim 64): every
// query scores a chunk before the next one, so the keys stream from memory once, at the pace
// of all the queries, and stay in the first-level cache while they are reused. The queries go
// in passes of eight (AVX-512: two runs at a time, 16 accumulators; the last few queries four
// runs at a time) or four (AVX2: one run, 8 accumulators). The first pass over a chunk fetches
// keys kAheadRuns runs ahead, on into the n_after runs that follow the list in the caller's.
constexpr std::int64_t kChunkRuns = 16;
constexpr std::int64_t kAheadRuns = 8;
void score_runs(const float* q, int n_q, const std::uint16_t* pool, const KeyRun* runs, std::int64_t n_runs,
                std::int64_t n_after, std::int64_t dim, std::int64_t stride, float scale, float* scores,
                std::int64_t ld) {
  std::int64_t out = 0;
  for (std::int64_t c = 0; c < n_runs; c += kChunkRuns) {
    const std::int64_t n = std::min(kChunkRuns, n_runs - c);
    const std::int64_t n_ahead = std::max<std::int64_t>(0, n_runs + n_after - c - kAheadRuns);
    int j = 0;
    const auto pass = [&](auto call) {
      call(q + j * dim, dim, pool, runs + c, n, stride, scale, scores + j * ld + out, ld,
           j == 0 && n_ahead > 0 ? runs + c + kAheadRuns : nullptr, n_ahead);
    };
#if defined(BATCHLM_KERNELS_AVX512)
    for (; j + 8 <= n_q; j += 8) pass(score_pass<8, 2>);
    switch (n_q - j) {
      case 7: pass(score_pass<7, 2>); break;
      case 6: pass(score_pass<6, 2>); break;
      case 5: pass(score_pass<5, 2>); break;
      case 4: pass(score_pass<4, 4>); break;
      case 3: pass(score_pass<3, 4>); break;
      case 2: pass(score_pass<2, 4>); break;
      case 1: pass(score_pass<1, 4>); break;
      default: break;
    }
#else
    for (; j + 4 <= n_q; j += 4) pass(score_pass<4>);
    switch (n_q - j) {
      case 3: pass(score_pass<3>); break;
      case 2: pass(score_pass<2>); break;
      case 1: pass(score_pass<1>); break;
      default: break;
    }
#endif
    for (std::int64_t i = c; i < c + n; ++i) out += runs[i].n;
  }
}

#if defined(BATCHLM_KERNELS_AVX512)
// NQ queries' sums over value rows [0, n_rows), added to out (64 per query): 4 NQ accumulators
// in registers, each row converted from F16 in registers and used at once by all of them, and
// every element's sum taken row by row. With no staging buffer the value stream costs no store
// and reload, so even one query runs close to its multiply-adds. Rows are fetched
// kPrefetchRows ahead, up to rows[n_fetch - 1] (n_fetch >= n_rows: on into the caller's next
// rows).
template <int NQ>
void mix_pass(const float* probs, std::int64_t ld, const std::uint16_t* pool, const std::int64_t* rows,
              std::int64_t n_rows, std::int64_t n_fetch, float* out) {
  __m512 a[NQ][4];
#pragma GCC unroll 8
  for (int u = 0; u < NQ; ++u)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[u][c] = _mm512_loadu_ps(out + u * 64 + c * 16);
  for (std::int64_t r = 0; r < std::min(n_fetch, kPrefetchRows); ++r) prefetch_row(pool, rows[r]);
  for (std::int64_t r = 0; r < n_rows; ++r) {
    if (r + kPrefetchRows < n_fetch) prefetch_row(pool, rows[r + kPrefetchRows]);
    const auto* v = reinterpret_cast<const __m256i*>(pool + rows[r]);
    __m512 w[NQ];
#pragma GCC unroll 8
    for (int u = 0; u < NQ; ++u) w[u] = _mm512_set1_ps(probs[u * ld + r]);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // a quarter of the row at a time: 24 + 6 + 1 registers at most
      const __m512 vc = cvtph16(_mm256_loadu_si256(v + c));
#pragma GCC unroll 8
      for (int u = 0; u < NQ; ++u) a[u][c] = _mm512_fmadd_ps(w[u], vc, a[u][c]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < NQ; ++u)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + u * 64 + c * 16, a[u][c]);
}
#endif

// Head dimension 64: each query keeps its 64 sums in registers across the rows (the
// per-element sums of axpy_f16, in row order).
void mix_rows(const float* probs, int n_q, const std::uint16_t* pool, const std::int64_t* rows,
              std::int64_t n_rows, [[maybe_unused]] std::int64_t n_after, std::int64_t dim, float* out, std::int64_t ld) {
  if (dim != 64) {
    for (int j = 0; j < n_q; ++j)
      for (std::int64_t r = 0; r < n_rows; ++r) axpy_f16(probs[j * ld + r], pool + rows[r], out + j * dim, dim);
    return;
  }
#if defined(BATCHLM_KERNELS_AVX512)
  // Sixteen lanes, six queries per pass over the rows (24 accumulators), the rest in one last
  // pass: each element's sum is still taken row by row, so the results are those of the
  // eight-lane loop below. The last pass fetches on into the caller's next rows.
  int j = 0;
  const auto pass = [&]<int NQ>() {
    mix_pass<NQ>(probs + j * ld, ld, pool, rows, n_rows, j + NQ == n_q ? n_rows + n_after : n_rows, out + j * 64);
  };
  for (; j + 6 <= n_q; j += 6) pass.template operator()<6>();
  switch (n_q - j) {
    case 5: pass.template operator()<5>(); break;
    case 4: pass.template operator()<4>(); break;
    case 3: pass.template operator()<3>(); break;
    case 2: pass.template operator()<2>(); break;
    case 1: pass.template operator()<1>(); break;
    default: break;
  }
#else
  constexpr std::int64_t kChunk = 32;
  alignas(64) float vf[kChunk * 64];
  for (std::int64_t r0 = 0; r0 < n_rows; r0 += kChunk) {
    const std::int64_t nr = std::min(kChunk, n_rows - r0);
    for (std::int64_t r = 0; r < nr; ++r) {
      const auto* v = reinterpret_cast<const __m128i*>(pool + rows[r0 + r]);
      for (int c = 0; c < 8; ++c) _mm256_store_ps(vf + r * 64 + c * 8, _mm256_cvtph_ps(_mm_loadu_si128(v + c)));
    }
    for (int j = 0; j < n_q; ++j) {
      float* o = out + j * 64;
      const float* p = probs + j * ld + r0;
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + c * 8);
      for (std::int64_t r = 0; r < nr; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + r);
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(pr, _mm256_load_ps(vf + r * 64 + c * 8), acc[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + c * 8, acc[c]);
    }
  }
#endif
}

// expf as glibc computes it on CPUs with FMA, four lanes at a time in double precision (eight
// in the AVX-512 build), so the softmax gets std::exp's values bit for bit at vector speed:
// x * 32/ln2 = k + r with k an integer, exp(x) = 2^(k/32) * 2^(r/32), the first factor from a
// 32-entry table of 2^(i/32) (exponent bits folded in) and the second a cubic in r. The
// polynomial coefficients are glibc's; the table is computed here. Lanes at or beyond |x| >= 88 (where expf overflows,
// underflows or returns NaN/Inf) are handed to std::exp.
struct ExpTable {
  std::uint64_t entry[32];
  ExpTable() {
    for (int i = 0; i < 32; ++i) {
      const double v = static_cast<double>(std::exp2l(static_cast<long double>(i) / 32.0L));
      std::uint64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      entry[i] = bits - (static_cast<std::uint64_t>(i) << 47);
    }
  }
};
const ExpTable& exp_table() {
  static const ExpTable table;
  return table;
}

// glibc's constants for it: 32 / ln2, the shift that leaves k in the low mantissa bits, and
// the cubic's coefficients over r (scaled for r in units of 1/32).
constexpr double kExpInvLn2N = 0x1.71547652b82fep+0 * 32;
constexpr double kExpShift = 0x1.8p+52;
constexpr double kExpC1 = 0x1.62e42ff0c52d6p-1 / 32.0;
constexpr double kExpC2 = 0x1.ebfce50fac4f3p-3 / (32.0 * 32.0);
constexpr double kExpC3 = 0x1.c6af84b912394p-5 / (32.0 * 32.0 * 32.0);

#if defined(BATCHLM_KERNELS_AVX512)
// Eight lanes at once in 512-bit doubles (the AVX2 build: two halves of four, exp4 below), the
// same operations lane by lane (zero-masking forms with every lane selected, as in Rows16).
inline __m256 exp8_wide(__m256 x, const ExpTable& table) {
  const __m512d inv_ln2_n = _mm512_set1_pd(kExpInvLn2N);
  const __m512d shift = _mm512_set1_pd(kExpShift);
  const __m512d xd = _mm512_maskz_cvtps_pd(0xff, x);
  const __m512d kd_shifted = _mm512_fmadd_pd(inv_ln2_n, xd, shift);
  const __m512d kd = _mm512_sub_pd(kd_shifted, shift);
  const __m512d r = _mm512_fmsub_pd(inv_ln2_n, xd, kd);
  const __m512i ki = _mm512_castpd_si512(kd_shifted);
  const __m512i index = _mm512_and_si512(ki, _mm512_set1_epi64(31));
  const __m512i t = _mm512_add_epi64(_mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xff, index, table.entry, 8),
                                     _mm512_maskz_slli_epi64(0xff, ki, 47));
  const __m512d z = _mm512_fmadd_pd(r, _mm512_set1_pd(kExpC3), _mm512_set1_pd(kExpC2));
  const __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(kExpC1), _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  y = _mm512_mul_pd(y, _mm512_castsi512_pd(t));
  return _mm512_maskz_cvtpd_ps(0xff, y);
}
#else
inline __m128 exp4(__m128 x, const ExpTable& table) {
  const __m256d inv_ln2_n = _mm256_set1_pd(kExpInvLn2N);
  const __m256d shift = _mm256_set1_pd(kExpShift);
  const __m256d xd = _mm256_cvtps_pd(x);
  const __m256d kd_shifted = _mm256_fmadd_pd(inv_ln2_n, xd, shift);
  const __m256d kd = _mm256_sub_pd(kd_shifted, shift);
  const __m256d r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
  const __m256i ki = _mm256_castpd_si256(kd_shifted);
  const __m256i index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
  const __m256i t = _mm256_add_epi64(
      _mm256_i64gather_epi64(reinterpret_cast<const long long*>(table.entry), index, 8),
      _mm256_slli_epi64(ki, 47));
  const __m256d z = _mm256_fmadd_pd(r, _mm256_set1_pd(kExpC3), _mm256_set1_pd(kExpC2));
  const __m256d r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(kExpC1), _mm256_set1_pd(1.0));
  y = _mm256_fmadd_pd(z, r2, y);
  y = _mm256_mul_pd(y, _mm256_castsi256_pd(t));
  return _mm256_cvtpd_ps(y);
}
#endif

inline __m256 exp8(__m256 x, const ExpTable& table) {
  const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(88.0f),
                                   _CMP_NLT_UQ);  // |x| >= 88 or NaN
  if (_mm256_movemask_ps(big) != 0) {
    alignas(32) float t[8];
    _mm256_store_ps(t, x);
    for (float& v : t) v = std::exp(v);
    return _mm256_load_ps(t);
  }
#if defined(BATCHLM_KERNELS_AVX512)
  return exp8_wide(x, table);
#else
  return _mm256_set_m128(exp4(_mm256_extractf128_ps(x, 1), table), exp4(_mm256_castps256_ps128(x), table));
#endif
}

// e^r for x = n ln2 + r (x clamped to xc, n the nearest integer to x / ln2), at any vector
// width: r with ln2 in two parts, so r is exact, then 1 + r + r^2 P(r) with P of degree 5 (the
// classic Cephes coefficients). The caller multiplies by 2^n.
template <class V>
inline typename V::F exp_mantissa(typename V::F xc, typename V::F n) {
  typename V::F r = V::fnmadd(n, V::floats(0.693359375f), xc);
  r = V::fnmadd(n, V::floats(-2.12194440e-4f), r);
  typename V::F y = V::floats(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = V::fma(y, r, V::floats(c));
  y = V::fma(y, V::mul(r, r), r);
  return V::fadd(y, V::floats(1.0f));
}

// e^x for the softmax's x - max <= 0, in float arithmetic: x = n ln2 + r with |r| <= ln2 / 2,
// e^r from exp_mantissa, then 2^n through the exponent bits. Within 2 ulp of std::exp. x is
// first raised to -87 (e^-87 is about 1.6e-38, still a normal float), so every lane takes the
// same path; such a term is lost in the double sum (whose largest term is e^0 = 1) and rounds
// to 0 as an F16 probability, so the softmax is as if it were 0. The raising keeps a NaN (max
// returns its second operand when either is NaN), and a NaN stays NaN throughout.
inline __m256 softmax_exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = exp_mantissa<Rows8>(xc, n);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(BATCHLM_KERNELS_AVX512)
// softmax_exp8 on sixteen lanes, the same values: n is an integer in [-126, 0], so scaling by
// 2^n with scalef rounds as the multiplication by the float 2^n does.
inline __m512 softmax_exp16(__m512 x) {
  const __m512 xc = _mm512_maskz_max_ps(0xffff, _mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_maskz_roundscale_ps(0xffff, _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_scalef_ps(0xffff, exp_mantissa<Rows16>(xc, n), n);
}
#endif

// Positions [i, n) of a row, fewer than 8, through the same vector exp as the rest, their
// exponentials added to sum in order.
inline void softmax_tail(float* x, std::int64_t i, std::int64_t n, float max, double& sum) {
  if (i >= n) return;
  alignas(32) float t[8] = {};
  for (std::int64_t j = i; j < n; ++j) t[j - i] = x[j] - max;
  alignas(32) float e[8];
  _mm256_store_ps(e, softmax_exp8(_mm256_load_ps(t)));
  for (std::int64_t j = i; j < n; ++j) {
    x[j] = e[j - i];
    sum += x[j];
  }
}

// x[i, n) multiplied by inv, each rounded to the nearest F16 value: eight lanes, then one by one.
inline void scale_to_f16(float* x, std::int64_t i, std::int64_t n, float inv) {
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) x[i] = fp16_to_fp32(fp32_to_fp16(x[i] * inv));
}

#if defined(BATCHLM_KERNELS_AVX512)
// The sixteen-lane form for R rows of the same length n >= 16, `ld` apart, in lockstep: each
// row's maximum, exponentials and double sums are those of the row alone (the same operations
// in the same order), but the rows' chains of dependent additions interleave, so one row's
// additions run while another's wait. Alone, a row's sum is one long chain (two dependent
// double additions per 16 positions), which holds the loop back.
template <int R>
void softmax_f16_wide(float* x, std::int64_t ld, std::int64_t n) {
  // Sixteen lanes where eight lanes go below, with the same values: the maximum does not
  // depend on the order, each exponential is softmax_exp8's, and the double sums take the
  // same terms in the same order (lanes 0..3 of the accumulator are s0, lanes 4..7 are s1).
  __m512 m[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) m[r] = _mm512_loadu_ps(x + r * ld);
  std::int64_t i = 16;
  for (; i + 16 <= n; i += 16)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) m[r] = _mm512_maskz_max_ps(0xffff, m[r], _mm512_loadu_ps(x + r * ld + i));
  float max[R];
  __m512 vmax[R];
  __m512d s[R];
  for (int r = 0; r < R; ++r) {
    max[r] = hmax(_mm256_max_ps(half256(m[r], 0), half256(m[r], 1)));
    for (std::int64_t j = i; j < n; ++j) max[r] = std::max(max[r], x[r * ld + j]);
    vmax[r] = _mm512_set1_ps(max[r]);
    s[r] = _mm512_setzero_pd();
  }
  for (i = 0; i + 16 <= n; i += 16)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 e = softmax_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + r * ld + i), vmax[r]));
      _mm512_storeu_ps(x + r * ld + i, e);
      s[r] = _mm512_add_pd(s[r], _mm512_maskz_cvtps_pd(0xff, half256(e, 0)));
      s[r] = _mm512_add_pd(s[r], _mm512_maskz_cvtps_pd(0xff, half256(e, 1)));
    }
  for (int r = 0; r < R; ++r) {
    float* row = x + r * ld;
    std::int64_t j = i;
    if (j + 8 <= n) {
      const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), half256(vmax[r], 0)));
      _mm256_storeu_ps(row + j, e);
      s[r] = _mm512_add_pd(s[r], _mm512_maskz_cvtps_pd(0xff, e));
      j += 8;
    }
    alignas(64) double lanes[8];
    _mm512_store_pd(lanes, s[r]);
    double sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    softmax_tail(row, j, n, max[r], sum);
    const float inv = static_cast<float>(1.0 / sum);
    const __m512 vinv = _mm512_set1_ps(inv);
    j = 0;
    for (; j + 16 <= n; j += 16)
      _mm512_storeu_ps(row + j, cvtph16(_mm512_maskz_cvtps_ph(0xffff, _mm512_mul_ps(_mm512_loadu_ps(row + j), vinv),
                                                              _MM_FROUND_TO_NEAREST_INT)));
    scale_to_f16(row, j, n, inv);
  }
}
#endif

// One row of fewer than 16 positions (the AVX-512 build), or any row (the AVX2 build).
void softmax_f16_row(float* x, std::int64_t n) {
  float max = -INFINITY;
  double sum = 0.0;
  std::int64_t i = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    max = hmax(m);
  }
  for (; i < n; ++i) max = std::max(max, x[i]);
  const __m256 vmax = _mm256_set1_ps(max);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(x + i, e);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  softmax_tail(x, i, n, max, sum);
  scale_to_f16(x, 0, n, static_cast<float>(1.0 / sum));
}

void softmax_f16(float* x, std::int64_t n, std::int64_t ld, int rows) {
#if defined(BATCHLM_KERNELS_AVX512)
  if (n >= 16) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) softmax_f16_wide<4>(x + r * ld, ld, n);
    switch (rows - r) {
      case 3: softmax_f16_wide<3>(x + r * ld, ld, n); break;
      case 2: softmax_f16_wide<2>(x + r * ld, ld, n); break;
      case 1: softmax_f16_wide<1>(x + r * ld, ld, n); break;
      default: break;
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) softmax_f16_row(x + r * ld, n);
}

// out[i] = std::exp(x[i]) through the vector path (the softmax's exponentials, on their own).
void exp_f32(const float* x, float* out, std::int64_t n) {
  const ExpTable& table = exp_table();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_loadu_ps(x + i), table));
  for (; i < n; ++i) out[i] = std::exp(x[i]);
}

void to_f16(const float* x, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = fp32_to_fp16(x[i]);
}

void round_f16(float* x, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) x[i] = fp16_to_fp32(fp32_to_fp16(x[i]));
}

}  // namespace

const Kernels* BATCHLM_KERNELS_ENTRY() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
      !__builtin_cpu_supports("f16c")) {
    return nullptr;
  }
#if defined(BATCHLM_KERNELS_AVX512)
  if (!__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vnni")) {
    return nullptr;
  }
#elif defined(BATCHLM_KERNELS_VNNI)
  if (!__builtin_cpu_supports("avxvnni")) return nullptr;
#endif
  static const Kernels k{BATCHLM_KERNELS_NAME,
                         BATCHLM_KERNELS_TILE_TOKENS,
                         tile_q4_0,
                         tile_q4_1,
                         tile_q8_0,
                         tile_f16,
                         portable_kernels().tile_bf16,
                         tile_f32,
                         packed_tile<PackedType::Q4_0>,
                         packed_tile<PackedType::Q4_1>,
                         packed_tile<PackedType::Q8_0>,
                         quantize_q8_t<false>,
                         quantize_q8_t<true>,
                         axpy_f16,
                         to_f16,
                         round_f16,
                         score_runs,
                         mix_rows,
                         softmax_f16,
                         exp_f32,
                         tile_q5_0,
                         tile_q5_1,
                         tile_q4_k,
                         tile_q5_k,
                         tile_q6_k,
                         quantize_q8_k,
                         packed_tile<PackedType::Q5_1>,
                         packed_tile<PackedType::Q4_K>,
                         packed_tile<PackedType::Q5_K>,
                         packed_tile<PackedType::Q6_K>};
  return &k;
}

}  // namespace batchlm::kernels::cpu

#else

namespace batchlm::kernels::cpu {
const Kernels* BATCHLM_KERNELS_ENTRY() { return nullptr; }
}  // namespace batchlm::kernels::cpu

#endif
