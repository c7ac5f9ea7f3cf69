#include "batchlm/core/json_check.hpp"

#include <stdexcept>
#include <unordered_map>
#include <vector>

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

// Builds the value as nlohmann's DOM parser does, but appends each key to its object rather
// than inserting it (which searches the keys before it); an object past a few keys gets an index
// of its keys, so a repeated one is still found at once.
class OrderedBuilder : public nlohmann::json_sax<nlohmann::ordered_json> {
 public:
  using ojson = nlohmann::ordered_json;

  bool null() override { return add(ojson(nullptr)); }
  bool boolean(bool v) override { return add(ojson(v)); }
  bool number_integer(number_integer_t v) override { return add(ojson(v)); }
  bool number_unsigned(number_unsigned_t v) override { return add(ojson(v)); }
  bool number_float(number_float_t v, const string_t& text) override {
    add(ojson(v));
    // Without a fraction or an exponent it was an integer, past 64 bits.
    if (!wide && text.find_first_of(".eE") == string_t::npos) wide = WideInteger{path(), text};
    return true;
  }
  bool string(string_t& v) override { return add(ojson(std::move(v))); }
  bool binary(binary_t& v) override { return add(ojson::binary(std::move(v))); }
  bool start_object(std::size_t) override { return open(ojson::object()); }
  bool start_array(std::size_t) override { return open(ojson::array()); }
  bool key(string_t& k) override {
    frames_.back().key = std::move(k);
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool end_array() override {
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    throw std::invalid_argument(std::string("parse_ordered_json: text not checked first: ") + e.what());
  }

  ojson root;
  std::optional<std::string> duplicate;
  std::optional<WideInteger> wide;

 private:
  static constexpr std::size_t kScanned = 16;  // keys looked through before an object is indexed

  struct Frame {
    ojson* value;
    std::string key;                                       // an object's key read last
    std::size_t count = 0;                                 // an array's elements begun
    std::unordered_map<std::string_view, std::size_t> index;  // an object's keys past kScanned
  };

  bool open(ojson&& empty) {
    ojson* at = place(std::move(empty));
    frames_.push_back(Frame{at, {}, 0, {}});
    return true;
  }
  bool add(ojson&& value) {
    place(std::move(value));
    return true;
  }

  ojson* place(ojson&& value) {
    if (frames_.empty()) {
      root = std::move(value);
      return &root;
    }
    Frame& frame = frames_.back();
    if (frame.value->is_array()) {
      ++frame.count;
      auto& array = frame.value->get_ref<ojson::array_t&>();
      array.push_back(std::move(value));
      return &array.back();
    }
    // As the vector of (key, value) it is: ordered_map's own members look keys up.
    auto& object = static_cast<ojson::object_t::Container&>(frame.value->get_ref<ojson::object_t&>());
    std::optional<std::size_t> found;
    if (object.size() <= kScanned) {
      for (std::size_t i = 0; i < object.size(); ++i)
        if (object[i].first == frame.key) found = i;
    } else {
      if (frame.index.empty())
        for (std::size_t i = 0; i < object.size(); ++i) frame.index.emplace(object[i].first, i);
      if (const auto it = frame.index.find(frame.key); it != frame.index.end()) found = it->second;
    }
    if (found) {
      if (!duplicate) duplicate = path();
      object[*found].second = std::move(value);
      return &object[*found].second;
    }
    // Appended without ordered_map's search. Keys move with their vector as it grows, so the
    // index (views of them) is rebuilt when it would go stale.
    const bool moves = object.size() == object.capacity();
    object.emplace_back(frame.key, std::move(value));  // the key stays for a path to name
    if (moves) frame.index.clear();
    if (!frame.index.empty() || object.size() > kScanned) {
      if (frame.index.empty())
        for (std::size_t i = 0; i < object.size(); ++i) frame.index.emplace(object[i].first, i);
      else
        frame.index.emplace(object.back().first, object.size() - 1);
    }
    return &object.back().second;
  }

  std::string path() const {
    std::string out;
    for (const Frame& f : frames_) {
      if (f.value->is_object()) {
        if (!out.empty()) out += '.';
        out += f.key;
      } else {
        out += '[';
        out += std::to_string(f.count - 1);
        out += ']';
      }
    }
    return out;
  }

  std::vector<Frame> frames_;
};

}  // namespace

nlohmann::ordered_json parse_ordered_json(std::string_view text, std::optional<std::string>* duplicate,
                                          std::optional<WideInteger>* wide) {
  OrderedBuilder builder;
  nlohmann::ordered_json::sax_parse(text, &builder);
  if (duplicate != nullptr) *duplicate = std::move(builder.duplicate);
  if (wide != nullptr) *wide = std::move(builder.wide);
  return std::move(builder.root);
}

std::optional<JsonProblem> check_json(std::string_view text, std::size_t max_depth) {
  Checker checker(max_depth);
  json::sax_parse(text, &checker);
  return checker.problem;
}

}  // namespace batchlm
