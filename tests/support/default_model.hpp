#pragma once
// The default model (models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched by scripts/fetch-model.sh)
// for tests that need real weights and a real tokenizer: loaded once per test program, and
// skipped where it is absent. Test programs define BATCHLM_SOURCE_DIR.

#include <filesystem>
#include <memory>

#include "batchlm/local_engine/model.hpp"

namespace batchlm::testing {

inline const std::filesystem::path& default_model_path() {
  static const std::filesystem::path p =
      std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  return p;
}

// Null when the file is absent.
inline std::shared_ptr<const local_engine::Model> default_model() {
  static const std::shared_ptr<const local_engine::Model> model =
      std::filesystem::exists(default_model_path()) ? local_engine::Model::load(default_model_path()) : nullptr;
  return model;
}

}  // namespace batchlm::testing

// In a test body: skip the test where the default model is absent.
#define REQUIRE_DEFAULT_MODEL()                                                              \
  if (!::batchlm::testing::default_model())                                                  \
  GTEST_SKIP() << ::batchlm::testing::default_model_path() << " is absent (scripts/fetch-model.sh fetches it)"
