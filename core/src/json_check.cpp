#include "batchlm/core/json_check.hpp"

#include <nlohmann/json.hpp>

namespace batchlm {

namespace {

using json = nlohmann::json;

// Reads events without keeping them; the first problem stops the parse.
class Checker : public json::json_sax_t {
 public:
  explicit Checker(std::size_t max_depth) : max_depth_(max_depth) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool key(string_t&) override { return true; }
  bool start_object(std::size_t) override { return enter(); }
  bool start_array(std::size_t) override { return enter(); }
  bool end_object() override { return leave(); }
  bool end_array() override { return leave(); }
  bool parse_error(std::size_t position, const std::string& token, const json::exception& e) override {
    // nlohmann's exception 406: a number that does not fit a double.
    if (e.id == 406) problem = JsonProblem{JsonProblem::Kind::kNumberOutOfRange, position, token};
    else problem = JsonProblem{JsonProblem::Kind::kSyntax, position, {}, detail_of(e.what())};
    return false;
  }

  // "...: syntax error while parsing value - invalid literal; last read: 'tru'" gives
  // "invalid literal": the input it quotes may be anything, bytes that are not UTF-8 included.
  static std::string detail_of(std::string_view what) {
    const std::size_t dash = what.find(" - ");
    if (dash == std::string_view::npos) return {};
    std::string_view detail = what.substr(dash + 3);
    if (const std::size_t quoted = detail.find("; last read: "); quoted != std::string_view::npos)
      detail = detail.substr(0, quoted);
    return std::string(detail);
  }

  std::optional<JsonProblem> problem;

 private:
  bool enter() {
    if (++depth_ <= max_depth_) return true;
    problem = JsonProblem{JsonProblem::Kind::kTooDeep, 0, {}};
    return false;
  }
  bool leave() {
    --depth_;
    return true;
  }

  std::size_t max_depth_;
  std::size_t depth_ = 0;
};

}  // namespace

std::optional<JsonProblem> check_json(std::string_view text, std::size_t max_depth) {
  Checker checker(max_depth);
  json::sax_parse(text, &checker);
  return checker.problem;
}

}  // namespace batchlm
