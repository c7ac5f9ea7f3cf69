// The Llama forward pass: embeddings, then per layer RMSNorm, attention with rotary positions
// and grouped-query heads over the F16 KV cache, RMSNorm and a SwiGLU MLP, each with a
// residual; then the final norm and the output head (the embedding matrix when tied). Qwen2
// is the same network with biases on the query, key and value products and its rotary pairs
// in halves of each head; Qwen3 has no biases but normalizes each head's query and key, and
// its heads may be wider than n_embd / n_heads. Phi-3 is Llama's network with its rotary pairs
// in halves, stored with Q, K and V in one matrix and gate and up in another (loaded as views
// of their rows), and for its long-context models factors dividing the rotary angles and one
// multiplying their cosines and sines. Gemma scales the embeddings and the queries, gates its
// MLP with GELU, and (Gemma 2 and 3) norms each block's output before the residual addition
// and runs most layers' attention over a sliding window; Gemma 2 caps scores and logits.

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <new>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>

#include "batchlm/local_engine/model.hpp"

namespace batchlm::local_engine {

namespace kops = batchlm::kernels;

namespace {
constexpr std::size_t kAlign = 64;  // the KV store's alignment (see KvStore)
// Rows (tokens) per share of the small row-wise steps: a few tokens stay on the calling thread.
constexpr std::int64_t kRowGrain = 4;
}  // namespace

KvStore::KvStore(const ModelConfig& config, std::int64_t block_size, std::int64_t n_blocks,
                 std::int64_t n_layers) {
  const std::int64_t layer_stride = n_blocks * block_size * config.kv_width();
  const std::int64_t layers = n_layers > 0 ? std::min(n_layers, config.n_layers) : config.n_layers;
  const auto total = static_cast<std::size_t>(layers * layer_stride);
  const auto allocate = [&] {
    return static_cast<std::uint16_t*>(::operator new[](total * sizeof(std::uint16_t), std::align_val_t{kAlign}));
  };
  k_.reset(allocate());
  v_.reset(allocate());
  elements_ = total;
  layers_ = layers;
  pool_ = KvPool{k_.get(), v_.get(), layer_stride, block_size, n_blocks};
}

void KvStore::copy_block(std::int64_t from, std::int64_t to) {
  if (from < 0 || from >= pool_.n_blocks || to < 0 || to >= pool_.n_blocks)
    throw std::out_of_range("KvStore: copy of block " + std::to_string(from) + " to " + std::to_string(to) +
                            " outside the pool of " + std::to_string(pool_.n_blocks));
  if (from == to) return;
  // A block is one contiguous run per layer (its keys transposed within it, its values by row).
  const std::int64_t block = pool_.layer_stride / pool_.n_blocks;
  for (std::uint16_t* base : {k_.get(), v_.get()})
    for (std::int64_t l = 0; l < layers_; ++l)
      std::memcpy(base + l * pool_.layer_stride + to * block, base + l * pool_.layer_stride + from * block,
                  static_cast<std::size_t>(block) * sizeof(std::uint16_t));
}

void KvStore::commit(kops::ThreadPool& threads) {
  // Pieces of 2 MB, so that both threads fault pages at once.
  constexpr std::size_t kPiece = (std::size_t{2} << 20) / sizeof(std::uint16_t);
  const auto pieces = static_cast<std::int64_t>((elements_ + kPiece - 1) / kPiece);
  for (std::uint16_t* base : {k_.get(), v_.get()})
    threads.parallel_for(pieces, 1, [&](std::int64_t b, std::int64_t e, int) {
      const std::size_t from = static_cast<std::size_t>(b) * kPiece;
      const std::size_t to = std::min(elements_, static_cast<std::size_t>(e) * kPiece);
      std::memset(base + from, 0, (to - from) * sizeof(std::uint16_t));
    });
}

void KvStore::Free::operator()(std::uint16_t* p) const { ::operator delete[](p, std::align_val_t{kAlign}); }

void KvCache::resize(std::int64_t n) {
  if (n < 0 || n > size_) throw std::out_of_range("KvCache::resize beyond the filled positions");
  size_ = n;
}

Model::Model(gguf::File file) : file_(std::move(file)) {}

std::shared_ptr<Model> Model::load(const std::filesystem::path& path, bool check_only, std::int64_t context) {
  std::shared_ptr<Model> m(new Model(gguf::File::open(path)));
  m->check_only_ = check_only;
  const gguf::File& f = m->file_;
  ModelConfig& c = m->config_;

  c.architecture = f.get_string("general.architecture");
  if (c.architecture == "qwen2" || c.architecture == "qwen3") {
    // Stored as the checkpoints have it: no permuted query and key rows, so the rotary pairs
    // are halves of each head.
    c.rope_style = kops::RopeStyle::kHalves;
    c.qk_norm = c.architecture == "qwen3";
  } else if (c.architecture == "phi3") {
    // Converted from the checkpoints as they are: rotary pairs in halves.
    c.rope_style = kops::RopeStyle::kHalves;
  } else if (c.architecture == "gemma" || c.architecture == "gemma2" || c.architecture == "gemma3") {
    // Rotary pairs in halves; GELU-gated MLPs; Gemma 2 and 3 norm each block's output, and
    // Gemma 3 each head's query and key.
    c.rope_style = kops::RopeStyle::kHalves;
    c.gelu = true;
    c.post_norms = c.architecture != "gemma";
    c.qk_norm = c.architecture == "gemma3";
  } else if (c.architecture != "llama") {
    f.fail("architecture " + gguf::quote_name(c.architecture) +
           " is not supported (this build runs the 'llama', 'qwen2', 'qwen3', 'phi3', 'gemma', 'gemma2' and "
           "'gemma3' architectures)");
  }
  const bool gemma = c.gelu;
  c.name = f.find_string("general.name").value_or("");
  const std::string a = c.architecture + ".";
  auto positive = [&](const std::string& key) {
    const std::uint64_t v = f.get_u64(key);
    if (v == 0 || v > (1u << 24)) f.fail("metadata '" + key + "' = " + std::to_string(v) + " is out of range");
    return static_cast<std::int64_t>(v);
  };
  c.n_layers = positive(a + "block_count");
  c.n_embd = positive(a + "embedding_length");
  c.n_ff = positive(a + "feed_forward_length");
  c.n_heads = positive(a + "attention.head_count");
  c.n_kv_heads = f.find(a + "attention.head_count_kv") ? positive(a + "attention.head_count_kv")
                                                         : c.n_heads;
  c.n_ctx_train = f.find(a + "context_length") ? positive(a + "context_length") : 2048;
  if (!f.find(a + "attention.key_length") && c.n_embd % c.n_heads != 0) {
    f.fail("embedding_length " + std::to_string(c.n_embd) + " is not a multiple of head_count " +
           std::to_string(c.n_heads));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    f.fail("head_count " + std::to_string(c.n_heads) + " is not a multiple of head_count_kv " +
           std::to_string(c.n_kv_heads));
  }
  c.head_dim = f.find(a + "attention.key_length") ? positive(a + "attention.key_length")
                                                   : c.n_embd / c.n_heads;
  // Qwen3's heads are wider than n_embd / n_heads: the query product widens, the output one
  // narrows back.
  if (const auto v = f.find_u64(a + "attention.value_length"); v && static_cast<std::int64_t>(*v) != c.head_dim)
    f.fail("attention.value_length " + std::to_string(*v) + " differs from key_length " + std::to_string(c.head_dim) +
           " (this build runs heads whose keys and values are as long)");
  c.rope_dim = f.find(a + "rope.dimension_count") ? positive(a + "rope.dimension_count") : c.head_dim;
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 != 0) {
    f.fail("rope.dimension_count " + std::to_string(c.rope_dim) + " does not fit head size " +
           std::to_string(c.head_dim));
  }
  // llama.cpp's Qwen graphs rotate whole heads (Phi-4-mini's rotates three quarters of each).
  if ((c.architecture == "qwen2" || c.architecture == "qwen3") && c.rope_dim != c.head_dim)
    f.fail("rope.dimension_count " + std::to_string(c.rope_dim) + " is not the head size " + std::to_string(c.head_dim) +
           " (the '" + c.architecture + "' architecture rotates whole heads)");
  // Values no model has, which make every output a NaN: refused here, not met at the first token.
  const auto number = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return std::string(text);
  };
  const double rope_base = f.find_f64(a + "rope.freq_base").value_or(10000.0);
  if (!(rope_base > 1.0 && rope_base < 1e30))
    f.fail("metadata '" + a + "rope.freq_base' = " + number(rope_base) + " is out of range (above 1)");
  const double rms_eps = f.find_f64(a + "attention.layer_norm_rms_epsilon").value_or(1e-5);
  // Bounds that hold in the float the kernels use: 5e-324 would be 0 there.
  if (!(rms_eps >= 1e-30 && rms_eps < 1.0))
    f.fail("metadata '" + a + "attention.layer_norm_rms_epsilon' = " + number(rms_eps) +
           " is out of range (1e-30 to 1)");
  c.rope_base = static_cast<float>(rope_base);
  c.rms_eps = static_cast<float>(rms_eps);
  const std::optional<std::string> scaling = f.find_string(a + "rope.scaling.type");
  if (scaling && *scaling != "none" && *scaling != "linear" && !(*scaling == "longrope" && c.architecture == "phi3"))
    f.fail("rope scaling '" + *scaling + "' is not supported");
  // A scaling factor scales the positions linearly (the angles by 1 / factor) unless the type
  // says "none" (llama.cpp then ignores it). The older key is rope.scale_linear.
  const std::string factor_key = f.find(a + "rope.scaling.factor") ? a + "rope.scaling.factor" : a + "rope.scale_linear";
  if (const auto factor = f.find_f64(factor_key); factor && *factor != 0.0 && *factor != 1.0 && scaling != "none") {
    if (scaling == "longrope")
      f.fail("metadata '" + factor_key + "' = " + number(*factor) + " with longrope scaling is not supported");
    if (!(*factor >= 1e-6 && *factor < 1e6))
      f.fail("metadata '" + factor_key + "' = " + number(*factor) + " is out of range (1e-06 to 1e+06)");
    c.rope_freq_scale = static_cast<float>(1.0 / *factor);
  }
  if (const auto attn = f.find_f64(a + "rope.scaling.attn_factor")) {
    if (!(*attn >= 1e-6 && *attn < 100.0))
      f.fail("metadata '" + a + "rope.scaling.attn_factor' = " + number(*attn) + " is out of range (1e-06 to 100)");
    c.rope_attn_factor = static_cast<float>(*attn);
  }
  if (f.find(a + "rope.scaling.original_context_length"))
    c.n_ctx_orig = positive(a + "rope.scaling.original_context_length");
  if (gemma) {
    // As llama.cpp has them: the embeddings times sqrt(n_embd); queries times
    // 1 / sqrt(head size), or for the 27B models (by their layer counts)
    // 1 / sqrt(n_embd / n_heads).
    c.embd_scale = std::sqrt(static_cast<float>(c.n_embd));
    const bool big = (c.architecture == "gemma2" && c.n_layers == 46) || (c.architecture == "gemma3" && c.n_layers == 62);
    if (big && c.n_embd < c.n_heads)
      f.fail("embedding_length " + std::to_string(c.n_embd) + " is less than head_count " + std::to_string(c.n_heads));
    c.q_scale = 1.0f / std::sqrt(static_cast<float>(big ? c.n_embd / c.n_heads : c.head_dim));
    const auto cap = [&](const std::string& key, double fallback) {
      const double v = f.find_f64(a + key).value_or(fallback);
      if (!(v >= 0.0 && v < 1e6)) f.fail("metadata '" + a + key + "' = " + number(v) + " is out of range (0 or above)");
      return static_cast<float>(v);
    };
    if (c.architecture == "gemma2") {
      c.attn_softcap = cap("attn_logit_softcapping", 50.0);
      c.final_softcap = cap("final_logit_softcapping", 30.0);
    } else if (c.architecture == "gemma3") {
      c.final_softcap = cap("final_logit_softcapping", 0.0);
    }
    // Sliding windows: Gemma 2 in every other layer (4,096 positions unless the file says),
    // Gemma 3 in five layers of six where the file gives a window. The window layers rotate
    // with rope.freq_base_swa: Gemma 2's default is the model's base and scale, Gemma 3's
    // 10,000 unscaled.
    const bool has_window = f.find(a + "attention.sliding_window") != nullptr;
    if (c.architecture == "gemma2" || (c.architecture == "gemma3" && has_window && f.get_u64(a + "attention.sliding_window") > 0)) {
      c.sliding_window = has_window ? positive(a + "attention.sliding_window") : 4096;
      c.swa_layers.assign(static_cast<std::size_t>(c.n_layers), false);
      const std::string pattern_key = a + "attention.sliding_window_pattern";
      if (const gguf::Value* pattern = f.find(pattern_key); pattern && pattern->type == gguf::ValueType::Array) {
        // A flag per layer (booleans, or integers where not 0 means windowed, as llama.cpp reads them).
        const gguf::Array& flags = pattern->as_array(pattern_key);
        if (static_cast<std::int64_t>(flags.items.size()) != c.n_layers)
          f.fail("metadata '" + pattern_key + "' has " + std::to_string(flags.items.size()) + " entries for " +
                 std::to_string(c.n_layers) + " layers");
        for (std::size_t i = 0; i < flags.items.size(); ++i) {
          const gguf::Value& flag = flags.items[i];
          if (flag.type == gguf::ValueType::Bool)
            c.swa_layers[i] = flag.as_bool(pattern_key);
          else if (flag.type == gguf::ValueType::I32 || flag.type == gguf::ValueType::U32)
            c.swa_layers[i] = flag.as_i64(pattern_key) != 0;
          else
            f.fail("metadata '" + pattern_key + "' holds " + std::string(gguf::to_string(flag.type)) +
                   " values (expected booleans, one per layer)");
        }
      } else {
        // Every n-th layer sees the whole context, the others the window (0: every layer windowed).
        const std::uint64_t every = pattern ? f.get_u64(pattern_key) : (c.architecture == "gemma2" ? 2 : 6);
        if (every > (1u << 24)) f.fail("metadata '" + pattern_key + "' = " + std::to_string(every) + " is out of range");
        for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(c.n_layers); ++i) c.swa_layers[i] = every == 0 || i % every < every - 1;
      }
      const double base_swa = f.find_f64(a + "rope.freq_base_swa").value_or(c.architecture == "gemma2" ? rope_base : 10000.0);
      if (!(base_swa > 1.0 && base_swa < 1e30))
        f.fail("metadata '" + a + "rope.freq_base_swa' = " + number(base_swa) + " is out of range (above 1)");
      c.rope_base_swa = static_cast<float>(base_swa);
      c.rope_freq_scale_swa = c.architecture == "gemma2" ? c.rope_freq_scale : 1.0f;
    }
  }

  // Tokenizer first: the vocabulary size it gives is what the embedding must have.
  Vocab vocab = Vocab::from_gguf(f);
  try {
    m->tokenizer_ = std::make_unique<Tokenizer>(vocab);
  } catch (const std::invalid_argument& e) {
    f.fail(std::string("tokenizer: ") + e.what());
  }
  try {
    m->chat_template_ = std::make_unique<ChatTemplate>(ChatTemplate::from_vocab(vocab));
  } catch (const std::invalid_argument&) {
    // Raw-text generation still works; chat_template() reports the problem when asked.
  }
  c.n_vocab = static_cast<std::int64_t>(m->tokenizer_->size());
  if (auto declared = f.find_u64(a + "vocab_size");
      declared && static_cast<std::int64_t>(*declared) != c.n_vocab) {
    f.fail("vocab_size " + std::to_string(*declared) + " does not match the " +
           std::to_string(c.n_vocab) + " tokens of the tokenizer");
  }

  // Every tensor of the file must be one the forward pass reads: a tensor this build does not
  // know (a bias, a norm, scaling factors of another variant) would otherwise be left out of the
  // network without a word, and its outputs be wrong.
  std::set<std::string, std::less<>> used;
  const auto info = [&](const std::string& name, std::vector<std::int64_t> shape) -> const gguf::TensorInfo& {
    used.insert(name);
    return f.tensor(name, shape);
  };
  // The matrices a tensor holds, their rows one after the other (one, or Phi-3's Q, K and V in
  // attn_qkv and gate and up in ffn_up): each a view of its rows. Quantized matrices also get
  // the CPU kernels' packed copy (8 rows interleaved), which the products read instead of the
  // file's layout; data stays the file's bytes.
  auto parts = [&](const std::string& name, std::int64_t cols, std::vector<std::int64_t> rows) {
    std::int64_t total = 0;
    for (const std::int64_t r : rows) total += r;
    const gguf::TensorInfo& t = info(name, {cols, total});
    if (*t.type == kops::DType::Q8_1 || *t.type == kops::DType::Q8_K) {
      f.fail("tensor '" + name + "' is " + std::string(t.type_name()) +
             ", a type for activations, not weights");
    }
    std::vector<kops::Matrix> out;
    const std::size_t row_bytes = kops::row_bytes(*t.type, cols);
    std::int64_t first = 0;
    for (const std::int64_t r : rows) {
      kops::Matrix w{*t.type, t.data + static_cast<std::size_t>(first) * row_bytes, r, cols};
      if (!check_only) w.packed = m->packed_.emplace_back(kops::pack_weights(w)).data();
      out.push_back(w);
      first += r;
    }
    return out;
  };
  auto matrix = [&](const std::string& name, std::int64_t cols, std::int64_t rows) {
    return parts(name, cols, {rows}).front();
  };
  auto vector = [&](const std::string& name, std::int64_t n) {
    const gguf::TensorInfo& t = info(name, {n});
    if (t.type != kops::DType::F32) {
      f.fail("tensor '" + name + "' has type " + std::string(t.type_name()) +
             ", expected F32");
    }
    return reinterpret_cast<const float*>(t.data);
  };

  m->token_embd_ = matrix("token_embd.weight", c.n_embd, c.n_vocab);
  m->output_norm_ = vector("output_norm.weight", c.n_embd);
  // Gemma and Gemma 2 always take the embedding matrix as their output head (as llama.cpp does).
  if (f.find_tensor("output.weight") && c.architecture != "gemma" && c.architecture != "gemma2") {
    m->output_ = matrix("output.weight", c.n_embd, c.n_vocab);
  } else {
    m->output_ = m->token_embd_;
    c.tied_embeddings = true;
  }
  // Factors dividing the rotary angles, checked positive.
  const auto factors = [&](const std::string& name) {
    const float* v = vector(name, c.rope_dim / 2);
    for (std::int64_t i = 0; i < c.rope_dim / 2; ++i)
      if (!(v[i] > 0.0f && std::isfinite(v[i])))
        f.fail("tensor '" + name + "' holds " + number(v[i]) + " at " + std::to_string(i) +
               " (the factors divide the rotary angles: they must be positive)");
    return v;
  };
  if (f.find_tensor("rope_freqs.weight") && c.architecture == "llama") {
    m->rope_freqs_ = factors("rope_freqs.weight");
    c.rope_freq_factors = true;
  }
  // Phi-3's long-context models: as llama.cpp chooses them, the short factors where the context
  // is at most the original one, the long ones past it (the magnitude factor either way). The
  // context is the one asked for, which the engine takes as it is up to the training context.
  if (c.architecture == "phi3" && (f.find_tensor("rope_factors_short.weight") || f.find_tensor("rope_factors_long.weight"))) {
    const float* short_factors = factors("rope_factors_short.weight");
    const float* long_factors = factors("rope_factors_long.weight");
    c.rope_freq_factors = true;
    c.rope_long_factors = true;
    c.long_context = c.n_ctx_orig > 0 && c.n_ctx_train > c.n_ctx_orig && context > c.n_ctx_orig;
    m->rope_freqs_ = c.long_context ? long_factors : short_factors;
  }
  // Biases on the query, key and value products where the first layer has them (Qwen2 does;
  // llama.cpp reads them in any of these architectures), and then in every layer.
  c.qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  const std::int64_t kv = c.kv_width(), qw = c.q_width();
  for (std::int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights l;
    l.attn_norm = vector(p + "attn_norm.weight", c.n_embd);
    if (c.architecture == "phi3" && f.find_tensor(p + "attn_qkv.weight")) {
      const std::vector<kops::Matrix> qkv = parts(p + "attn_qkv.weight", c.n_embd, {qw, kv, kv});
      l.attn_q = qkv[0];
      l.attn_k = qkv[1];
      l.attn_v = qkv[2];
    } else {
      l.attn_q = matrix(p + "attn_q.weight", c.n_embd, qw);
      l.attn_k = matrix(p + "attn_k.weight", c.n_embd, kv);
      l.attn_v = matrix(p + "attn_v.weight", c.n_embd, kv);
    }
    if (c.qkv_bias) {
      l.attn_q_bias = vector(p + "attn_q.bias", qw);
      l.attn_k_bias = vector(p + "attn_k.bias", kv);
      l.attn_v_bias = vector(p + "attn_v.bias", kv);
    }
    if (c.qk_norm) {
      l.attn_q_norm = vector(p + "attn_q_norm.weight", c.head_dim);
      l.attn_k_norm = vector(p + "attn_k_norm.weight", c.head_dim);
    }
    l.attn_out = matrix(p + "attn_output.weight", qw, c.n_embd);
    if (c.post_norms) {
      l.attn_post_norm = vector(p + "post_attention_norm.weight", c.n_embd);
      l.ffn_post_norm = vector(p + "post_ffw_norm.weight", c.n_embd);
    }
    l.ffn_norm = vector(p + "ffn_norm.weight", c.n_embd);
    if (c.architecture == "phi3") {
      // The gate's rows, then the up product's.
      const std::vector<kops::Matrix> gate_up = parts(p + "ffn_up.weight", c.n_embd, {c.n_ff, c.n_ff});
      l.ffn_gate = gate_up[0];
      l.ffn_up = gate_up[1];
    } else {
      l.ffn_gate = matrix(p + "ffn_gate.weight", c.n_embd, c.n_ff);
      l.ffn_up = matrix(p + "ffn_up.weight", c.n_embd, c.n_ff);
    }
    l.ffn_down = matrix(p + "ffn_down.weight", c.n_ff, c.n_embd);
    m->layers_.push_back(l);
  }
  for (const gguf::TensorInfo& t : f.tensors()) {
    if (!used.contains(t.name))
      f.fail("tensor '" + t.name + "' is not part of the '" + c.architecture +
             "' architecture as this build runs it (a variant it does not support)");
  }
  return m;
}

const ChatTemplate& Model::chat_template() const {
  if (!chat_template_) {
    throw std::runtime_error(file_.path().string() +
                             ": the model's chat template is not one this build supports "
                             "(supported: " + kSupportedChatTemplates + ")");
  }
  return *chat_template_;
}

void Model::forward(std::span<const Token> tokens, KvCache& cache, std::span<float> logits,
                    bool all_logits, kops::ThreadPool& pool) const {
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n == 0) return;
  if (cache.size() + n > cache.capacity()) throw std::length_error("forward: KV cache is full");
  std::vector<std::int32_t> positions(static_cast<std::size_t>(n));
  std::iota(positions.begin(), positions.end(), static_cast<std::int32_t>(cache.size()));
  const std::vector<std::int32_t> sequence_of(static_cast<std::size_t>(n), 0);
  const std::int32_t block[1] = {0};
  const std::span<const std::int32_t> tables[1] = {block};
  std::vector<std::int32_t> rows;
  if (all_logits) {
    rows.resize(static_cast<std::size_t>(n));
    std::iota(rows.begin(), rows.end(), 0);
  } else {
    rows.push_back(static_cast<std::int32_t>(n - 1));
  }
  forward_batch(Batch{tokens, positions, sequence_of, tables, rows}, cache.pool(), logits, pool);
  cache.size_ += n;
}

std::int64_t Model::check_batch(const Batch& b, std::int64_t block_size, std::int64_t n_blocks,
                               std::size_t logits_size) const {
  const ModelConfig& c = config_;
  const auto n = static_cast<std::int64_t>(b.tokens.size());
  if (n > kMaxBatch) throw std::invalid_argument("forward: more tokens than kMaxBatch");
  if (static_cast<std::int64_t>(b.positions.size()) != n ||
      static_cast<std::int64_t>(b.sequence_of.size()) != n) {
    throw std::invalid_argument("forward: tokens, positions and sequence_of differ in length");
  }
  if (b.layers < 0 || b.layers > c.n_layers)
    throw std::invalid_argument("forward: layers " + std::to_string(b.layers) + " is not in 0.." +
                                std::to_string(c.n_layers));
  const auto n_out = static_cast<std::int64_t>(b.logits_rows.size());
  if (static_cast<std::int64_t>(logits_size) < n_out * c.n_vocab) {
    throw std::invalid_argument("forward: logits buffer too small");
  }
  for (std::int64_t i = 0; i < n_out; ++i) {
    if (b.logits_rows[i] < 0 || b.logits_rows[i] >= n || (i > 0 && b.logits_rows[i] <= b.logits_rows[i - 1]))
      throw std::invalid_argument("forward: logits_rows must be increasing token indices");
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const Token t = b.tokens[i];
    if (t < 0 || t >= c.n_vocab) {
      throw std::out_of_range("forward: token id " + std::to_string(t) + " is outside the vocabulary");
    }
    const std::int32_t s = b.sequence_of[i];
    if (s < 0 || static_cast<std::size_t>(s) >= b.block_tables.size() || b.positions[i] < 0)
      throw std::invalid_argument("forward: token " + std::to_string(i) + " has no sequence or position");
    const auto& table = b.block_tables[s];
    // Every block this token's attention reads, up to its own position, must be in the pool.
    const std::int64_t last_block = b.positions[i] / block_size;
    if (last_block >= static_cast<std::int64_t>(table.size()))
      throw std::invalid_argument("forward: position " + std::to_string(b.positions[i]) +
                                  " is beyond its sequence's block table");
    for (std::int64_t j = 0; j <= last_block; ++j)
      if (table[j] < 0 || table[j] >= n_blocks)
        throw std::invalid_argument("forward: block " + std::to_string(table[j]) + " is outside the pool");
  }
  return b.layers > 0 ? b.layers : c.n_layers;
}

void Model::forward_batch(const Batch& b, const KvPool& kv, std::span<float> logits,
                          kops::ThreadPool& pool) const {
  const ModelConfig& c = config_;
  const auto n = static_cast<std::int64_t>(b.tokens.size());
  if (n == 0) return;
  const std::int64_t n_layers = check_batch(b, kv.block_size, kv.n_blocks, logits.size());
  const auto n_out = static_cast<std::int64_t>(b.logits_rows.size());

  const std::int64_t E = c.n_embd, KV = c.kv_width(), F = c.n_ff;
  const std::int64_t QW = c.q_width();
  std::vector<float> x(n * E), xn(n * E), q(n * QW), k(n * KV), v(n * KV), att(n * QW);
  std::vector<float> gate(n * F), up(n * F);
  std::size_t scratch_bytes = 0;
  for (const LayerWeights& l : layers_) {
    const kops::Matrix qkv[3] = {l.attn_q, l.attn_k, l.attn_v};
    const kops::Matrix gate_up[2] = {l.ffn_gate, l.ffn_up};
    scratch_bytes = std::max({scratch_bytes, kops::group_activation_bytes(qkv, n),
                              kops::group_activation_bytes(gate_up, n),
                              kops::activation_bytes(l.attn_out, n),
                              kops::activation_bytes(l.ffn_down, n)});
  }
  scratch_bytes = std::max(scratch_bytes, kops::activation_bytes(output_, n_out));
  std::vector<std::uint8_t> scratch(scratch_bytes);

  kops::get_rows(token_embd_, b.tokens, x.data());
  if (c.embd_scale != 1.0f)
    for (float& e : x) e *= c.embd_scale;

  // Gemma scales its queries itself, and its scores are then taken unscaled.
  const kops::AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim, KV,
                                   c.q_scale != 0.0f ? 1.0f : 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                                   0, c.attn_softcap};
  kops::AttentionShape window_shape = shape;
  window_shape.window = c.sliding_window;
  // The rotary angles of the tokens' positions, the same in every layer (the window layers'
  // where they rotate differently).
  const std::vector<float> angles = kops::rope_angles(n, c.rope_dim, b.positions.data(), c.rope_base, rope_freqs_,
                                                      c.rope_attn_factor, c.rope_freq_scale);
  const bool own_angles = c.sliding_window > 0 && (c.rope_base_swa != c.rope_base || c.rope_freq_scale_swa != c.rope_freq_scale);
  const std::vector<float> window_angles =
      own_angles ? kops::rope_angles(n, c.rope_dim, b.positions.data(), c.rope_base_swa, rope_freqs_,
                                     c.rope_attn_factor, c.rope_freq_scale_swa)
                 : std::vector<float>{};
  for (std::int64_t li = 0; li < n_layers; ++li) {
    const LayerWeights& l = layers_[li];
    const bool windowed = c.sliding_window > 0 && c.swa_layers[static_cast<std::size_t>(li)];
    const std::vector<float>& layer_angles = windowed && own_angles ? window_angles : angles;
    // Later layers' input norm is taken with the previous layer's last residual addition.
    if (li == 0) kops::rms_norm(x.data(), l.attn_norm, n, E, c.rms_eps, xn.data(), pool);
    const kops::Matrix qkv[3] = {l.attn_q, l.attn_k, l.attn_v};
    float* const qkv_out[3] = {q.data(), k.data(), v.data()};
    kops::matmul_group(qkv, xn.data(), n, qkv_out, scratch.data(), pool);
    std::uint16_t* kc = kv.k + li * kv.layer_stride;
    std::uint16_t* vc = kv.v + li * kv.layer_stride;
    const kops::PagedKv paged{kc, vc, kv.block_size, b.block_tables, b.sequence_of.data()};
    // Rotary positions and the cache stores, token by token: shared among the threads.
    pool.parallel_for(n, kRowGrain, [&](std::int64_t t0, std::int64_t t1, int) {
      const std::int64_t m = t1 - t0;
      const std::int32_t* at = b.positions.data() + t0;
      const float* cos_sin = layer_angles.data() + t0 * c.rope_dim;
      if (c.qkv_bias) {
        for (std::int64_t t = t0; t < t1; ++t) {
          kops::add(q.data() + t * QW, l.attn_q_bias, QW);
          kops::add(k.data() + t * KV, l.attn_k_bias, KV);
          kops::add(v.data() + t * KV, l.attn_v_bias, KV);
        }
      }
      if (c.qk_norm) {
        // Qwen3: each head's query and key RMS-normalized over its own dims, before rotation.
        kops::rms_norm(q.data() + t0 * QW, l.attn_q_norm, m * c.n_heads, c.head_dim, c.rms_eps, q.data() + t0 * QW);
        kops::rms_norm(k.data() + t0 * KV, l.attn_k_norm, m * c.n_kv_heads, c.head_dim, c.rms_eps, k.data() + t0 * KV);
      }
      kops::rope(q.data() + t0 * QW, m, c.n_heads, c.head_dim, c.rope_dim, cos_sin, c.rope_style);
      kops::rope(k.data() + t0 * KV, m, c.n_kv_heads, c.head_dim, c.rope_dim, cos_sin, c.rope_style);
      if (c.q_scale != 0.0f)
        for (float* e = q.data() + t0 * QW; e != q.data() + t1 * QW; ++e) *e *= c.q_scale;
      kops::PagedKv part = paged;
      part.sequence_of += t0;
      kops::store_keys_paged(k.data() + t0 * KV, m, KV, at, part, kc);
      kops::store_f16_paged(v.data() + t0 * KV, m, KV, at, part, vc);
    });
    kops::attention_paged(windowed ? window_shape : shape, q.data(), n, b.positions.data(), paged, att.data(), pool);

    // After the last layer's attention only the rows whose logits are wanted go on: they are
    // gathered to the front of x and att.
    std::int64_t rows = n;
    if (li == n_layers - 1 && n_out < n) {
      for (std::int64_t i = 0; i < n_out; ++i) {
        const std::int64_t r = b.logits_rows[i];
        if (r == i) continue;
        std::copy_n(x.data() + r * E, E, x.data() + i * E);
        std::copy_n(att.data() + r * QW, QW, att.data() + i * QW);
      }
      rows = n_out;
    }
    if (rows == 0) break;
    kops::matmul(l.attn_out, att.data(), rows, xn.data(), scratch.data(), pool);
    if (c.post_norms) kops::rms_norm(xn.data(), l.attn_post_norm, rows, E, c.rms_eps, xn.data(), pool);
    kops::add_rms_norm(x.data(), xn.data(), l.ffn_norm, rows, E, c.rms_eps, xn.data(), pool);
    const kops::Matrix gate_up[2] = {l.ffn_gate, l.ffn_up};
    float* const gate_up_out[2] = {gate.data(), up.data()};
    kops::matmul_group(gate_up, xn.data(), rows, gate_up_out, scratch.data(), pool);
    if (c.gelu)
      kops::geglu(gate.data(), up.data(), rows * F, pool);
    else
      kops::swiglu(gate.data(), up.data(), rows * F, pool);
    kops::matmul(l.ffn_down, gate.data(), rows, xn.data(), scratch.data(), pool);
    if (c.post_norms) kops::rms_norm(xn.data(), l.ffn_post_norm, rows, E, c.rms_eps, xn.data(), pool);
    // The residual addition, then the next norm: the next layer's input norm, or after the last
    // layer (whose rows are then the n_out wanted ones) the final norm.
    const float* next_norm = li + 1 < n_layers ? layers_[li + 1].attn_norm : output_norm_;
    kops::add_rms_norm(x.data(), xn.data(), next_norm, rows, E, c.rms_eps, xn.data(), pool);
  }
  if (n_out == 0) return;
  kops::matmul(output_, xn.data(), n_out, logits.data(), scratch.data(), pool);
  if (c.final_softcap != 0.0f) kops::softcap(logits.data(), n_out * c.n_vocab, c.final_softcap);
}

}  // namespace batchlm::local_engine
