#pragma once
// Scorers turn a completion into a verdict. Failures of the infrastructure are never scored.

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "batchlm/runner/job.hpp"

namespace batchlm::runner {

// GSM8K answers. Numbers are normalised: commas and '$' removed, a trailing '.' dropped,
// "42.0" == "42".
std::optional<std::string> gsm8k_gold(std::string_view reference);        // from "#### N"
std::optional<std::string> gsm8k_extract_strict(std::string_view output);  // "#### N" form
std::optional<std::string> gsm8k_extract_flexible(std::string_view output);  // last number
std::string normalize_number(std::string_view number);

class Scorer {
 public:
  virtual ~Scorer() = default;
  // The record's "score" value, e.g. {"strict": true, "flexible": false}; null when the item
  // has no reference to score against.
  virtual nlohmann::json score(const nlohmann::json& input, std::string_view output) const = 0;
  // Names of the boolean metrics in score() objects, for the summary ("strict", "flexible").
  virtual std::vector<std::string> metrics() const = 0;
};

// nullptr for ScoringKind::None.
std::unique_ptr<Scorer> make_scorer(const ScoringSpec& spec);

}  // namespace batchlm::runner
