// Sampling on the device (cuda.hpp sample): one 512-thread CTA per row.
//
// The semantics are the CPU sampler's (local_engine/sampling): temperature <= 0 or top_k == 1
// is kernels::argmax (the first index on ties). A row holding a NaN or an infinity anywhere
// gives -1: the forward pass broke down, and the engine fails the request, as the CPU's check
// (local_engine broken_logits) does.
// Otherwise the candidates are the tokens with (logit - max) / t > -30 (the same F32 expression
// as the CPU), ordered by logit (descending) then token id (ascending); top_k keeps the first
// top_k of them, top_p then keeps the shortest prefix of that order whose probability reaches
// top_p, and one token is drawn from what is left, in proportion to exp((logit - max) / t).
//
// How, without sorting:
// - Each candidate's logit is mapped to an order-preserving 32-bit key. The k-th largest key
//   (top-k) and the key where the cumulative probability crosses top_p (top-p) are found by
//   radix selection: 4 passes of 8 bits, each a 256-bin histogram in shared memory. Ties at
//   the threshold key are resolved by token id (the lower ids are kept, as the CPU sampler
//   does) with one ordered counting pass.
// - Probabilities are fixed point: W = round(exp(x) * 2^40) as a 64-bit integer (x <= 0, so
//   W <= 2^40; with at most 2^23 tokens no sum overflows). Every sum is then exact and
//   independent of the order of addition, so histograms may use atomics, the selection is
//   deterministic, and the final total is known exactly. A token with exp(x) < 2^-41 (x < -28.4)
//   gets W = 0: it stays in the kept set but cannot be drawn (its true probability is below
//   5e-13 of the best token's).
// - The draw: r = floor(u * F) with u from sample_uniform and F the kept total, then the token
//   whose cumulative weight interval (in token-id order) holds r, by an ordered block scan.
// - The full row is read for the argmax / max, the top-k selection and one compaction pass
//   that copies the kept candidates (in id order) into shared memory when at most kCap = 4096
//   of them remain; the remaining passes (top-p, the draw) then run on that list. With more
//   candidates (top_k = 0 and a flat distribution) they stream over the row instead; the
//   results are identical either way.

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace batchlm::kernels::cuda {

namespace {

using u64 = unsigned long long;
using detail::kWarp;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarp;
constexpr int kCap = 4096;     // candidates compacted into shared memory
constexpr int kBins = 256;     // radix digit of 8 bits
constexpr std::int64_t kMaxVocab = std::int64_t{1} << 23;  // n * 2^40 < 2^64

// ---------------------------------------------------------------------------------------------
// The counter-based generator: output number `counter` of a SplitMix64 stream whose state
// starts at SplitMix64(seed), top 53 bits. The same code runs on host and device.
__host__ __device__ constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__host__ __device__ constexpr std::uint64_t uniform_bits53(std::uint64_t seed, std::uint64_t counter) {
  constexpr std::uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  const std::uint64_t state = mix64(seed + kGamma);
  return mix64(state + (counter + 1) * kGamma) >> 11;
}

// ---------------------------------------------------------------------------------------------
// Keys and weights.

// Order-preserving map of a float to 32 bits (larger float, larger key); -0 is taken as +0, as
// float comparison does.
__device__ __forceinline__ std::uint32_t float_key(float f) {
  if (f == 0.0f) f = 0.0f;
  const std::uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_float(std::uint32_t k) {
  const std::uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

// The fixed-point weight of a candidate with this key (a function of the key only, so that all
// tied candidates have the same weight).
struct Weight {
  float mx, t;
  __device__ u64 operator()(std::uint32_t key) const {
    const float x = (key_float(key) - mx) / t;  // in [-30, 0] for a candidate
    return __float2ull_rn(expf(x) * 0x1p40f);
  }
};
struct One {
  __device__ u64 operator()(std::uint32_t) const { return 1; }
};

// Keeps the elements above a threshold key, and those at the key up to position `cut`
// (inclusive; positions in the order of the source, i.e. token-id order).
struct Filter {
  bool active = false;
  std::uint32_t key = 0;
  long long cut = std::numeric_limits<long long>::max();
  __device__ bool pass(std::uint32_t k, long long c) const {
    return !active || k > key || (k == key && c <= cut);
  }
};

struct SampleShared {
  std::uint32_t keys[kCap];  // the compacted candidates, in token-id order
  std::int32_t ids[kCap];
  u64 hist[kBins];
  u64 warp_total[kWarps];
  float red_v[kWarps];
  long long red_i[kWarps];
  u64 sel_above, sel_at;
  std::uint32_t sel_bin;
  int sel_ok;
  long long pos;
};

// ---------------------------------------------------------------------------------------------
// Block helpers. Every one is called by all threads of the CTA in uniform control flow.

// Exclusive prefix sum of v over the threads in thread order, and the total. Exact (integers).
// Begins by writing warp_total: the previous call ended with a barrier after its last read.
__device__ u64 block_exclusive_scan(u64 v, SampleShared& sh, u64& total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  u64 incl = v;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const u64 y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == kWarp - 1) sh.warp_total[warp] = incl;
  __syncthreads();
  u64 offset = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const u64 s = sh.warp_total[w];
    if (w < warp) offset += s;
    all += s;
  }
  __syncthreads();
  total = all;
  return offset + incl - v;
}

// (value, index) preference of the argmax: a real (non-NaN) value beats none (index < 0), a
// larger value wins, equal values go to the lower index.
__device__ __forceinline__ bool better(float av, long long ai, float bv, long long bi) {
  if (ai < 0) return false;
  if (bi < 0) return true;
  return av > bv || (av == bv && ai < bi);
}

// kernels::argmax of the row and its largest value; -1 and -inf for an empty row or one with
// a NaN or an infinity anywhere.
__device__ void block_argmax(const float* x, long long n, SampleShared& sh, float& max_v, long long& arg) {
  float bv = -INFINITY;
  long long bi = -1;
  int broken = 0;
  for (long long i = threadIdx.x; i < n; i += kThreads) {
    const float v = x[i];
    broken |= !isfinite(v);
    if (!isnan(v) && (bi < 0 || v > bv)) {  // increasing i: the first of equal values stays
      bv = v;
      bi = i;
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const long long oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  broken = __syncthreads_or(broken);  // also: red_v / red_i are free
  if (lane == 0) {
    sh.red_v[warp] = bv;
    sh.red_i[warp] = bi;
  }
  __syncthreads();
  bv = -INFINITY;
  bi = -1;
  for (int w = 0; w < kWarps; ++w)
    if (better(sh.red_v[w], sh.red_i[w], bv, bi)) {
      bv = sh.red_v[w];
      bi = sh.red_i[w];
    }
  max_v = broken ? -INFINITY : bv;
  arg = broken ? -1 : bi;
}

struct Selected {
  std::uint32_t key = 0;
  u64 above = 0;  // the weight of the elements with a larger key
  u64 at = 0;     // the weight of the elements with this key
  bool ok = false;
};

// Warp 0: the digit bin where the weight, counted from the top bin down and starting from
// `above`, first reaches `target`.
__device__ void pick_bin(SampleShared& sh, u64 above, u64 target) {
  const int lane = threadIdx.x;  // < 32
  u64 local[8], sum = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    local[k] = sh.hist[kBins - 1 - 8 * lane - k];  // lane 0 holds the top bins
    sum += local[k];
  }
  u64 incl = sum;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const u64 y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  const u64 excl = incl - sum;
  // The lanes' intervals (above + excl, above + incl] are disjoint: at most one holds target.
  const bool here = above + excl < target && above + incl >= target;
  const unsigned ballot = __ballot_sync(0xffffffffu, here);
  if (lane == 0) sh.sel_ok = ballot != 0u;
  if (here) {
    u64 cum = above + excl;
    for (int k = 0; k < 8; ++k) {
      if (cum + local[k] >= target) {
        sh.sel_bin = static_cast<std::uint32_t>(kBins - 1 - 8 * lane - k);
        sh.sel_above = cum;
        sh.sel_at = local[k];
        break;
      }
      cum += local[k];
    }
  }
}

// The largest key K such that the weight of the elements with key >= K reaches target
// (target >= 1); ok = false when the total weight is below target. elem(c, key, index) says
// whether position c (< n) is an element, and gives its key and token id.
template <class Elem, class Wt>
__device__ Selected radix_select(Elem elem, long long n, Wt wt, u64 target, SampleShared& sh) {
  std::uint32_t prefix = 0, mask = 0;
  Selected sel;
  for (int shift = 24; shift >= 0; shift -= 8) {
    __syncthreads();  // the previous pass (and caller) are done with hist and sel_*
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    // Consecutive elements of a thread that fall in the same bin are added up first (one
    // atomic per run: when most candidates share the top digits, atomics do not pile up).
    int run_bin = -1;
    u64 run = 0;
    for (long long c = threadIdx.x; c < n; c += kThreads) {
      std::uint32_t key;
      long long index;
      if (!elem(c, key, index) || (key & mask) != prefix) continue;
      const int bin = static_cast<int>((key >> shift) & 0xffu);
      if (bin != run_bin) {
        if (run_bin >= 0 && run != 0) atomicAdd(&sh.hist[run_bin], run);
        run_bin = bin;
        run = 0;
      }
      run += wt(key);
    }
    if (run_bin >= 0 && run != 0) atomicAdd(&sh.hist[run_bin], run);
    __syncthreads();
    if (threadIdx.x < kWarp) pick_bin(sh, sel.above, target);
    __syncthreads();
    if (!sh.sel_ok) return Selected{};  // uniform: every thread reads the same flag
    prefix |= sh.sel_bin << shift;
    mask |= 0xffu << shift;
    sel.above = sh.sel_above;
    sel.at = sh.sel_at;
  }
  sel.key = prefix;
  sel.ok = true;
  return sel;
}

// The position of the nth (1-based) element in source order, or -1.
template <class Elem>
__device__ long long nth_position(Elem elem, long long n, u64 nth, SampleShared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) sh.pos = -1;
  __syncthreads();
  u64 carry = 0;
  for (long long base = 0; base < n; base += kThreads) {
    const long long c = base + threadIdx.x;
    std::uint32_t key;
    long long index;
    const u64 f = (c < n && elem(c, key, index)) ? 1 : 0;
    u64 total;
    const u64 excl = block_exclusive_scan(f, sh, total);
    if (f != 0 && carry + excl + 1 == nth) sh.pos = c;
    carry += total;
    if (carry >= nth) break;  // uniform
  }
  __syncthreads();
  return sh.pos;
}

// Copies the elements (key, token id) in source order into sh.keys / sh.ids while they fit;
// returns how many elements there are.
template <class Elem>
__device__ u64 compact(Elem elem, long long n, SampleShared& sh) {
  u64 carry = 0;
  for (long long base = 0; base < n; base += kThreads) {
    const long long c = base + threadIdx.x;
    std::uint32_t key = 0;
    long long index = 0;
    const bool f = c < n && elem(c, key, index);
    u64 total;
    const u64 slot = carry + block_exclusive_scan(f ? 1 : 0, sh, total);
    if (f && slot < static_cast<u64>(kCap)) {
      sh.keys[slot] = key;
      sh.ids[slot] = static_cast<std::int32_t>(index);
    }
    carry += total;
  }
  __syncthreads();  // the list is complete before anyone reads it
  return carry;
}

template <class Elem, class Wt>
__device__ u64 block_total(Elem elem, long long n, Wt wt, SampleShared& sh) {
  u64 sum = 0;
  for (long long c = threadIdx.x; c < n; c += kThreads) {
    std::uint32_t key;
    long long index;
    if (elem(c, key, index)) sum += wt(key);
  }
  u64 total;
  (void)block_exclusive_scan(sum, sh, total);
  return total;
}

// The token id of the element whose cumulative-weight interval [before, before + w) in source
// order holds r (r < the total weight), or -1.
template <class Elem, class Wt>
__device__ long long draw(Elem elem, long long n, Wt wt, u64 r, SampleShared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) sh.pos = -1;
  __syncthreads();
  u64 carry = 0;
  for (long long base = 0; base < n; base += kThreads) {
    const long long c = base + threadIdx.x;
    std::uint32_t key = 0;
    long long index = -1;
    u64 w = 0;
    if (c < n && elem(c, key, index)) w = wt(key);
    u64 total;
    const u64 before = carry + block_exclusive_scan(w, sh, total);
    if (w != 0 && before <= r && r < before + w) sh.pos = index;  // exactly one thread
    carry += total;
    if (carry > r) break;  // uniform
  }
  __syncthreads();
  return sh.pos;
}

// top-p on the elements of a source, then the draw. Returns the token id, or -1.
template <class Elem>
__device__ long long finish(Elem elem, long long n, const Weight& wt, const SampleParams& p,
                            SampleShared& sh) {
  const u64 total = block_total(elem, n, wt, sh);
  u64 kept_total = total;
  Filter fp;
  if (p.top_p < 1.0f && total > 0) {
    // The CPU keeps an element iff the probability before it (in logit order) is < top_p,
    // i.e. (weights before it) < top_p * total, i.e. < target = ceil(top_p * total).
    const double t = ceil(static_cast<double>(p.top_p) * static_cast<double>(total));
    const u64 target = t < 1.0 ? 1 : (t >= static_cast<double>(total) ? total : static_cast<u64>(t));
    const Selected sel = radix_select(elem, n, wt, target, sh);
    const u64 w_key = sel.ok ? wt(sel.key) : 0;
    if (w_key > 0) {
      // The tied elements at the threshold key all weigh w_key; keep them (by token id) while
      // the weight before each is below target. above < target <= above + at.
      const u64 ties = sel.at / w_key;
      u64 keep = (target - sel.above + w_key - 1) / w_key;
      if (keep > ties) keep = ties;
      if (keep < 1) keep = 1;
      fp.active = true;
      fp.key = sel.key;
      if (keep < ties) {
        const long long cut = nth_position(
            [&](long long c, std::uint32_t& key, long long& index) {
              return elem(c, key, index) && key == sel.key;
            },
            n, keep, sh);
        if (cut >= 0) fp.cut = cut;
        else keep = ties;  // not reached: then every tie stays, consistently with fp.cut
      }
      kept_total = sel.above + keep * w_key;
    }
  }
  if (kept_total == 0) return -1;
  const std::uint64_t bits = uniform_bits53(p.seed, p.counter);
  const u64 r = __umul64hi(static_cast<u64>(bits) << 11, kept_total);  // floor(u * total) < total
  return draw(
      [&](long long c, std::uint32_t& key, long long& index) {
        return elem(c, key, index) && fp.pass(key, c);
      },
      n, wt, r, sh);
}

// A non-greedy row: the token, or -1 (no candidate: the caller takes the argmax).
__device__ long long sample_row(const float* x, long long n, float mx, const SampleParams& p,
                                SampleShared& sh) {
  const float t = p.temperature;
  const Weight wt{mx, t};
  // The row's candidates, at position = token id.
  const auto candidate = [=](long long c, std::uint32_t& key, long long& index) {
    const float l = x[c];
    if (!((l - mx) / t > -30.0f)) return false;  // the CPU's test, the same F32 expression
    key = float_key(l);
    index = c;
    return true;
  };
  Filter fk;
  if (p.top_k > 0) {
    const Selected sel = radix_select(candidate, n, One{}, static_cast<u64>(p.top_k), sh);
    if (sel.ok) {  // at least top_k candidates: keep the top_k first
      fk.active = true;
      fk.key = sel.key;
      const u64 need = static_cast<u64>(p.top_k) - sel.above;  // 1 <= need <= at
      if (need < sel.at) {
        const long long cut = nth_position(
            [&](long long c, std::uint32_t& key, long long& index) {
              return candidate(c, key, index) && key == sel.key;
            },
            n, need, sh);
        if (cut >= 0) fk.cut = cut;
      }
    }
  }
  const auto kept_k = [&](long long c, std::uint32_t& key, long long& index) {
    return candidate(c, key, index) && fk.pass(key, c);
  };
  const u64 count = compact(kept_k, n, sh);
  if (count == 0) return -1;
  if (count <= static_cast<u64>(kCap)) {
    const std::uint32_t* keys = sh.keys;
    const std::int32_t* ids = sh.ids;
    const auto listed = [=](long long c, std::uint32_t& key, long long& index) {
      key = keys[c];
      index = ids[c];
      return true;
    };
    return finish(listed, static_cast<long long>(count), wt, p, sh);
  }
  return finish(kept_k, n, wt, p, sh);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, long long rows,
                                                          long long n_vocab, const SampleParams* params,
                                                          std::int32_t* tokens) {
  __shared__ SampleShared sh;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    __syncthreads();  // the previous row is done with sh
    const float* x = logits + row * n_vocab;
    const SampleParams p = params[row];
    float mx;
    long long arg;
    block_argmax(x, n_vocab, sh, mx, arg);
    long long token = arg;
    const bool greedy = p.temperature <= 0.0f || p.top_k == 1;  // as Sampler::greedy()
    if (arg < 0) {
      token = -1;  // a NaN or an infinity: no token can be chosen from this row
    } else if (!greedy) {
      const long long drawn = sample_row(x, n_vocab, mx, p, sh);
      if (drawn >= 0) token = drawn;
    }
    if (threadIdx.x == 0) tokens[row] = static_cast<std::int32_t>(token);
  }
}

}  // namespace

double sample_uniform(std::uint64_t seed, std::uint64_t counter) {
  return static_cast<double>(uniform_bits53(seed, counter)) * 0x1.0p-53;
}

std::size_t sample_scratch_bytes(std::int64_t rows, std::int64_t n_vocab) {
  (void)rows;
  (void)n_vocab;
  return 0;  // everything lives in shared memory
}

void sample(const float* logits, std::int64_t rows, std::int64_t n_vocab,
            const SampleParams* params, std::int32_t* tokens, void* scratch, cudaStream_t stream) {
  (void)scratch;
  if (n_vocab < 0 || n_vocab > kMaxVocab)
    throw std::invalid_argument("sample: n_vocab " + std::to_string(n_vocab) + " is not in [0, 2^23]");
  if (rows <= 0) return;
  const unsigned grid = static_cast<unsigned>(rows < 65536 ? rows : 65536);
  sample_kernel<<<grid, kThreads, 0, stream>>>(logits, rows, n_vocab, params, tokens);
  detail::check_launch("sample");
}

}  // namespace batchlm::kernels::cuda
