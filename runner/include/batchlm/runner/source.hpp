#pragma once
// Sources stream the job's items; memory stays flat whatever the input size.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "batchlm/core/types.hpp"
#include "batchlm/runner/job.hpp"

namespace batchlm::runner {

struct Item {
  nlohmann::json id;     // custom_id (string) or the input line number (1-based) / synth index
  std::string id_key;    // id.dump(): the key used for resume
  nlohmann::json input;  // the item's input fields (object); for Batch lines the whole line
  Request request;       // rendered
  std::int64_t estimated_prompt_tokens = 0;  // rough (bytes / 4), for rate limits and dry runs
};

class Source {
 public:
  virtual ~Source() = default;
  virtual std::optional<Item> next() = 0;
  // Number of items the source will yield (after the job's limit).
  virtual std::int64_t total() const = 0;
  // What validating the input found that is allowed but probably a mistake (printed first).
  virtual std::vector<std::string> warnings() const { return {}; }
  // How many of `ids` (Item::id_key) are ids of items this source yields: an output resumed
  // under a lower limit, or after the input changed, holds records of other items too.
  virtual std::int64_t count_own(const std::unordered_set<std::string>& ids) const = 0;
};

// Opens the job's source. Validates the whole input first (every line parses, every
// {{field}} resolves), throwing ConfigError naming the input file and line, so nothing is sent
// before the whole job validates.
std::unique_ptr<Source> open_source(const JobSpec& job);

// {{field}} / {{a.b}} substitution from a JSON object; strings inserted as-is, other values
// dumped as JSON. A missing or null field throws std::out_of_range naming the field.
std::string render_template(std::string_view tmpl, const nlohmann::json& fields);

}  // namespace batchlm::runner
