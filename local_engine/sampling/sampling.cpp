#include "batchlm/local_engine/sampling.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "batchlm/kernels/ops.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace batchlm::local_engine {

namespace {

// A token as one integer whose order is the order top-k and top-p keep tokens in: the larger
// logit first, and on equal logits the lower id first. The high half is the logit's bits
// turned so that unsigned order is descending logit order (-0 taken as +0, which compare
// equal); the low half is the id.
std::uint64_t rank_key(float logit, Token id) {
  std::uint32_t bits;
  std::memcpy(&bits, &logit, sizeof bits);
  if (bits == 0x80000000u) bits = 0;
  const std::uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<std::uint64_t>(~ascending) << 32) | static_cast<std::uint32_t>(id);
}

}  // namespace

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  for (const std::vector<Token>& word : params_.bad_words)
    if (!word.empty()) recent_limit_ = std::max(recent_limit_, word.size() - 1);
}

double Sampler::uniform() {
  // 53 random bits: the same sequence on every platform for a given seed.
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

double TokenDistribution::probability(Token token) const {
  const auto it = std::lower_bound(tokens.begin(), tokens.end(), token);
  if (it == tokens.end() || *it != token) return 0.0;
  return weights[static_cast<std::size_t>(it - tokens.begin())] / total;
}

bool broken_logits(std::span<const float> logits) {
  // NaN and the infinities are the floats whose exponent bits are all ones. Tested on the bits,
  // without a branch, the loop runs on vectors: 5 us for a 49,152-token row, where a float
  // comparison took 30.
  const float* p = logits.data();
  std::uint32_t any = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    any |= (~bits & 0x7f800000u) == 0 ? 1u : 0u;
  }
  return any != 0;
}

std::string broken_logits_message(std::int64_t generated) {
  return "the model's output is not a number (NaN or infinity) at generated token " + std::to_string(generated + 1) +
         ": its weights or settings (rope base, norm epsilon) do not work";
}

Token TokenDistribution::draw(double u) const {
  double r = u * total;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    r -= weights[i];
    if (r < 0.0) return tokens[i];
  }
  return tokens.back();
}

TokenDistribution TokenDistribution::point(Token token) {
  return TokenDistribution{{token}, {1.0}, 1.0};
}

void Sampler::observe(Token token) {
  ++observed_;
  if (recent_limit_ > 0) {
    if (recent_.size() == recent_limit_) recent_.erase(recent_.begin());
    recent_.push_back(token);
  }
  if (params_.repetition_penalty != 1.0f) {
    const auto it = std::lower_bound(seen_.begin(), seen_.end(), token);
    if (it == seen_.end() || *it != token) seen_.insert(it, token);
  }
  if (params_.presence_penalty == 0.0f && params_.frequency_penalty == 0.0f) return;
  for (auto& [t, n] : counts_)
    if (t == token) {
      ++n;
      return;
    }
  counts_.emplace_back(token, 1);
}

void Sampler::observe_prompt(std::span<const Token> prompt) {
  if (params_.repetition_penalty == 1.0f) return;
  seen_.insert(seen_.end(), prompt.begin(), prompt.end());
  std::sort(seen_.begin(), seen_.end());
  seen_.erase(std::unique(seen_.begin(), seen_.end()), seen_.end());
}

void Sampler::hold_back(std::vector<Token> ends) { ends_ = std::move(ends); }

std::span<const float> Sampler::adjust(std::span<const float> logits) {
  // The tokens banned here: those that would end the output before min_tokens, and the last
  // token of each bad word whose other tokens came last (a one-token word always).
  banned_.clear();
  if (observed_ < params_.min_tokens) banned_ = ends_;
  for (const std::vector<Token>& word : params_.bad_words) {
    if (word.empty() || recent_.size() < word.size() - 1) continue;
    if (std::equal(word.begin(), word.end() - 1, recent_.end() - static_cast<std::ptrdiff_t>(word.size() - 1)))
      banned_.push_back(word.back());
  }
  if (counts_.empty() && seen_.empty() && params_.logit_bias.empty() && banned_.empty()) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  for (const Token token : seen_) {
    if (token < 0 || static_cast<std::size_t>(token) >= adjusted_.size()) continue;
    float& x = adjusted_[static_cast<std::size_t>(token)];
    x = x > 0.0f ? x / params_.repetition_penalty : x * params_.repetition_penalty;
  }
  for (const auto& [token, n] : counts_) {
    if (token < 0 || static_cast<std::size_t>(token) >= adjusted_.size()) continue;
    adjusted_[static_cast<std::size_t>(token)] -=
        params_.frequency_penalty * static_cast<float>(n) + params_.presence_penalty;
  }
  for (const auto& [token, bias] : params_.logit_bias) {
    if (token < 0 || static_cast<std::size_t>(token) >= adjusted_.size()) continue;
    adjusted_[static_cast<std::size_t>(token)] += bias;
  }
  for (const Token token : banned_)
    if (token >= 0 && static_cast<std::size_t>(token) < adjusted_.size())
      adjusted_[static_cast<std::size_t>(token)] = -std::numeric_limits<float>::infinity();
  return adjusted_;
}

PositionLogprobs position_logprobs(std::span<const float> logits, Token token, int top) {
  PositionLogprobs out;
  out.token = token;
  if (logits.empty()) return out;
  const float max = logits[static_cast<std::size_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())))];
  // The sum of exp(logit - max): F32 exponentials on vectors (each within 6e-8 of the exact
  // term, far below what a float logprob shows), added in F64 in four running sums. Terms more
  // than 80 nats below the largest (which contributes 1) are below the sum's resolution even
  // all together: held at -87 they add nothing, and do not reach the scalar exponential that
  // the vector one hands arguments beyond 88 to. A NaN is held there too.
  const std::size_t n = logits.size();
  thread_local std::vector<float> terms;
  terms.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = logits[i] - max;
    terms[i] = x > -80.0f ? x : -87.0f;
  }
  kernels::exp_f32(terms.data(), terms.data(), static_cast<std::int64_t>(n));
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (std::size_t j = 0; j < 4; ++j) part[j] += terms[i + j];
  for (; i < n; ++i) part[0] += terms[i];
  const double sum = (part[0] + part[1]) + (part[2] + part[3]);
  const double log_total = static_cast<double>(max) + std::log(sum);
  const auto logprob = [&](Token t) { return static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(t)]) - log_total); };
  if (token >= 0 && static_cast<std::size_t>(token) < logits.size()) out.logprob = logprob(token);
  const std::size_t k = std::min(static_cast<std::size_t>(std::max(top, 0)), logits.size());
  if (k == 0) return out;
  // The k best in one pass: a small array kept sorted, best first, the lower id first on ties.
  std::vector<Token> best;
  best.reserve(k + 1);
  const auto better = [&](Token a, Token b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la != lb ? la > lb : a < b;
  };
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const auto t = static_cast<Token>(i);
    if (best.size() == k && !better(t, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), t, better), t);
    if (best.size() > k) best.pop_back();
  }
  out.top.reserve(k);
  for (const Token t : best) out.top.emplace_back(t, logprob(t));
  return out;
}

namespace {

// What choosing a token works in, by token id: its weight and its bucket; the rank keys of one
// bucket's tokens; the distribution being built. One per thread,
// reused from token to token (a vocabulary's worth of each, which a sampler per sequence would
// hold for as long as its request lives).
struct Scratch {
  std::vector<float> weights;
  std::vector<std::uint8_t> buckets;
  std::vector<std::uint64_t> ranks;
  TokenDistribution dist;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// A token's bucket: eighths of a nat below the best after temperature (x = (logit - max) / t,
// at least -64), 0 to 255 (NaN: 255). The candidates, x > -30, are exactly the buckets below
// kOut. A larger logit never falls in a later bucket.
constexpr std::size_t kOut = 240;
constexpr std::size_t kBuckets = 256;
std::uint8_t bucket_of(float x) {
  const float b = -x * 8.0f;
  return static_cast<std::uint8_t>(static_cast<int>(b < 255.0f ? b : 255.0f));
}

// x[i] = (row[i] - max) / t held at -64 or above, and each one's bucket. Half the tokens may
// fall either side of -64 or of a bucket edge in no pattern, and a compiler may turn the
// scalar selections into branches (GCC at -O2 does), so the SSE2 path, where there is one,
// makes them minimum and maximum instructions: the same values (MINPS and MAXPS give their
// second operand for a NaN, so a NaN is held at -64, which is no candidate either).
void scale_and_bucket(const float* row, std::size_t n, float max, float t, float* x, std::uint8_t* buckets) {
  std::size_t i = 0;
#if defined(__SSE2__)
  const __m128 vmax = _mm_set1_ps(max), vt = _mm_set1_ps(t), floor = _mm_set1_ps(-64.0f);
  const __m128 eighths = _mm_set1_ps(-8.0f), top = _mm_set1_ps(255.0f);
  for (; i + 16 <= n; i += 16) {
    __m128i q[4];
    for (std::size_t j = 0; j < 4; ++j) {
      const __m128 v = _mm_max_ps(_mm_div_ps(_mm_sub_ps(_mm_loadu_ps(row + i + 4 * j), vmax), vt), floor);
      _mm_storeu_ps(x + i + 4 * j, v);
      q[j] = _mm_cvttps_epi32(_mm_min_ps(_mm_mul_ps(v, eighths), top));
    }
    const __m128i packed = _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buckets + i), packed);
  }
#endif
  for (; i < n; ++i) {
    const float v = (row[i] - max) / t;
    x[i] = v < -64.0f ? -64.0f : v;
    buckets[i] = bucket_of(x[i]);
  }
}

// The tokens kept so far: the candidates, then those within a cut. Top-k and top-p each keep a
// run of the best by rank (logit descending, the lower id first): every token of the buckets
// before the one where the run ends, and of that bucket those ranked at most `last` (found by
// ranking only that bucket's tokens).
struct Cut {
  std::size_t bucket = kOut;  // every candidate
  std::uint64_t last = ~std::uint64_t{0};
  bool keeps(const Scratch& w, std::span<const float> logits, std::size_t i) const {
    const std::size_t b = w.buckets[i];
    return b < bucket || (b == bucket && b < kOut && rank_key(logits[i], static_cast<Token>(i)) <= last);
  }
};

// w.ranks = the rank keys of the kept tokens in `bucket`.
void collect_bucket(Scratch& w, std::span<const float> logits, const Cut& cut, std::size_t bucket) {
  w.ranks.clear();
  const std::uint8_t* buckets = w.buckets.data();
  for (std::size_t i = 0; i < w.buckets.size(); ++i)
    if (buckets[i] == bucket && cut.keeps(w, logits, i)) w.ranks.push_back(rank_key(logits[i], static_cast<Token>(i)));
}

// The k best of the candidates (k fewer than them).
Cut best(Scratch& w, std::span<const float> logits, std::size_t k) {
  // Counted in four interleaved tallies, so that a run of tokens in one bucket does not make
  // each count wait for the one before.
  std::array<std::array<std::uint32_t, kBuckets>, 4> tally{};
  const std::uint8_t* buckets = w.buckets.data();
  for (std::size_t i = 0; i < w.buckets.size(); ++i) ++tally[i & 3][buckets[i]];
  std::size_t before = 0, bucket = 0;
  for (;; ++bucket) {
    const std::size_t here = tally[0][bucket] + tally[1][bucket] + tally[2][bucket] + tally[3][bucket];
    if (before + here >= k) break;
    before += here;
  }
  collect_bucket(w, logits, Cut{}, bucket);
  const auto last = w.ranks.begin() + static_cast<std::ptrdiff_t>(k - before - 1);
  std::nth_element(w.ranks.begin(), last, w.ranks.end());
  return Cut{bucket, *last};
}

// Of the tokens `within` keeps, the shortest run of the best whose weight reaches top_p of
// theirs.
Cut nucleus(Scratch& w, std::span<const float> logits, const Cut& within, float top_p) {
  std::array<std::array<double, kBuckets>, 4> tally{};
  const std::uint8_t* buckets = w.buckets.data();
  const float* weights = w.weights.data();
  // Every token, without a branch: the buckets from kOut on (not candidates) are not counted.
  for (std::size_t i = 0; i < w.buckets.size(); ++i) tally[i & 3][buckets[i]] += weights[i];
  std::array<double, kBuckets> mass{};
  for (std::size_t b = 0; b < kOut; ++b) mass[b] = (tally[0][b] + tally[1][b]) + (tally[2][b] + tally[3][b]);
  if (within.bucket < kOut) {
    // Within a top-k cut: the buckets after its own count nothing, and its own only the tokens
    // it keeps (a few, found by a branch that is rarely taken).
    for (std::size_t b = within.bucket + 1; b < kOut; ++b) mass[b] = 0.0;
    double own = 0.0;
    for (std::size_t i = 0; i < w.buckets.size(); ++i)
      if (buckets[i] == within.bucket && within.keeps(w, logits, i)) own += weights[i];
    mass[within.bucket] = own;
  }
  double total = 0.0;
  for (std::size_t b = 0; b < kOut; ++b) total += mass[b];
  const double target = static_cast<double>(top_p) * total;
  double before = 0.0;
  std::size_t bucket = 0;
  while (bucket < kOut && before + mass[bucket] < target) before += mass[bucket++];
  // Rounding can leave the sum of every bucket a hair short of the target: all are kept.
  if (bucket == kOut) return within;
  collect_bucket(w, logits, within, bucket);
  std::sort(w.ranks.begin(), w.ranks.end());
  std::uint64_t last = w.ranks.back();
  double sum = before;
  for (const std::uint64_t key : w.ranks) {
    sum += w.weights[static_cast<std::uint32_t>(key)];
    if (sum >= target) {
      last = key;
      break;
    }
  }
  return Cut{bucket, last};
}

// Fills w.dist with the distribution to draw from (logits adjusted, not empty, not greedy): the
// kept tokens in id order with their weights.
void prepare(Scratch& w, std::span<const float> logits, const SamplingParams& params) {
  const std::size_t n = logits.size();
  const float t = params.temperature;
  const float max = logits[static_cast<std::size_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(n)))];
  // Every token's logit after temperature relative to the best, x <= 0, its weight exp(x), and
  // its bucket. Tokens more than 30 nats below the best (after temperature) have less than
  // 1e-13 of its probability and are not candidates. Below -64 x is held there: such a token is
  // only ever left out, and the vector exponential then does not meet the arguments it hands
  // to the scalar one (|x| >= 88), which low temperatures give most tokens. A NaN is no
  // candidate either. Each x is written where its weight then replaces it.
  w.weights.resize(n);
  w.buckets.resize(n);
  std::uint8_t* buckets = w.buckets.data();
  scale_and_bucket(logits.data(), n, max, t, w.weights.data(), buckets);
  kernels::exp_f32(w.weights.data(), w.weights.data(), static_cast<std::int64_t>(n));
  std::size_t candidates = 0;
  for (std::size_t i = 0; i < n; ++i) candidates += buckets[i] < kOut ? 1 : 0;
  if (candidates == 0) {
    // Only a row with a NaN or an infinity leaves no candidate (broken_logits tells such rows
    // apart before sampling): the largest number, as greedy decoding takes it.
    w.dist = TokenDistribution::point(static_cast<Token>(kernels::argmax(logits.data(), static_cast<std::int64_t>(n))));
    return;
  }
  // min_p and top_k each keep a run of the best: the shorter one is the cut.
  std::size_t keep = candidates;
  if (params.top_k > 0) keep = std::min(keep, static_cast<std::size_t>(params.top_k));
  if (params.min_p > 0.0f) {
    // The tokens whose weight (their probability relative to the best's, whose weight is 1)
    // is at least min_p; the best is always one of them.
    const float* weights = w.weights.data();
    std::size_t above = 0;
    for (std::size_t i = 0; i < n; ++i) above += buckets[i] < kOut && weights[i] >= params.min_p ? 1 : 0;
    keep = std::min(keep, std::max<std::size_t>(above, 1));
  }
  Cut cut;
  if (keep < candidates) cut = best(w, logits, keep);
  if (params.top_p < 1.0f) cut = nucleus(w, logits, cut, params.top_p);
  // The kept tokens in id order: each id is written, and counted only when kept (without a
  // branch on what may be every other token; the cut's own bucket is a few tokens).
  std::vector<Token>& kept_ids = w.dist.tokens;
  kept_ids.resize(n);
  Token* kept = kept_ids.data();
  std::size_t count = 0;
  if (cut.bucket == kOut) {
    for (std::size_t i = 0; i < n; ++i) {
      kept[count] = static_cast<Token>(i);
      count += buckets[i] < kOut ? 1 : 0;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      kept[count] = static_cast<Token>(i);
      const std::size_t b = buckets[i];
      bool in = b < cut.bucket;
      if (b == cut.bucket) in = cut.keeps(w, logits, i);
      count += in ? 1 : 0;
    }
  }
  kept_ids.resize(count);
  w.dist.weights.resize(count);
  double total = 0.0;
  const float* weights = w.weights.data();
  for (std::size_t j = 0; j < count; ++j) total += w.dist.weights[j] = weights[static_cast<std::size_t>(kept_ids[j])];
  w.dist.total = total;
}

}  // namespace

TokenDistribution Sampler::distribution(std::span<const float> raw) {
  const std::span<const float> logits = adjust(raw);
  if (logits.empty()) return TokenDistribution{};
  if (greedy())
    return TokenDistribution::point(static_cast<Token>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size()))));
  Scratch& w = scratch();
  prepare(w, logits, params_);
  return w.dist;
}

Token Sampler::sample(std::span<const float> raw) {
  const std::span<const float> logits = adjust(raw);
  if (logits.empty()) return 0;
  if (greedy()) return static_cast<Token>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())));
  Scratch& w = scratch();
  prepare(w, logits, params_);
  return w.dist.draw(uniform());
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
  for (const auto& s : stops_) longest_ = std::max(longest_, s.size());
}

std::string StopMatcher::feed(std::string_view text, bool armed) {
  if (stopped_) return {};
  pending_.append(text);
  if (stops_.empty()) return std::exchange(pending_, {});
  // The earliest stop string in the pending text that ends in armed text ends generation there.
  std::size_t first = std::string::npos;
  if (armed) {
    for (const auto& s : stops_)
      first = std::min(first, pending_.find(s, unarmed_ >= s.size() ? unarmed_ - s.size() + 1 : 0));
  } else {
    unarmed_ = pending_.size();
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that is a prefix of some stop string.
  std::size_t hold = 0;
  for (const auto& s : stops_) {
    for (std::size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  unarmed_ -= std::min(unarmed_, out.size());
  return out;
}

std::string StopMatcher::finish() {
  if (stopped_) return {};
  unarmed_ = 0;
  return std::exchange(pending_, {});
}

}  // namespace batchlm::local_engine
