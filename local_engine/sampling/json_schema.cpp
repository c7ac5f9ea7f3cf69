#include "batchlm/local_engine/json_schema.hpp"

#include <algorithm>
#include <bit>

namespace batchlm::local_engine {

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::uint64_t first_bits(std::size_t n) { return n >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << n) - 1; }

}  // namespace

SchemaState& SchemaState::operator=(const SchemaState& other) {
  lex_ = other.lex_;
  schema_ = other.schema_;
  depth_ = other.depth_;
  std::copy_n(other.frames_.begin(), depth_, frames_.begin());
  return *this;
}

bool SchemaState::in_plain_string() const {
  if (!lex_.in_plain_string() || depth_ == 0) return false;
  const Frame& f = frames_[static_cast<std::size_t>(depth_ - 1)];
  return f.kind == Kind::kAny || f.kind == Kind::kString;
}

bool SchemaState::push(const Frame& f) {
  if (depth_ >= kMaxFrames) return false;
  frames_[static_cast<std::size_t>(depth_++)] = f;
  return true;
}

bool SchemaState::begin_value(int from, unsigned char c, std::uint8_t depth) {
  const int kind = json_kind_of(c);
  if (kind < 0 || from < 0) return false;
  const int target = node(from).by_kind[static_cast<std::size_t>(kind)];
  // Only a value that can end within the depth limit may start.
  if (target < 0 || node(from).need[static_cast<std::size_t>(kind)] > JsonState::kMaxDepth - depth) return false;
  const SchemaNode& n = node(target);
  Frame f{};
  f.node = target;
  f.depth = depth;
  if (n.any) {
    f.kind = Kind::kAny;
    return push(f);
  }
  if (n.has_enum) {
    for (std::size_t i = 0; i < n.values.size(); ++i)
      if (static_cast<unsigned char>(n.values[i][0]) == c) f.cand |= std::uint64_t{1} << i;
    f.kind = Kind::kEnum;
    f.pos = 1;
    return f.cand != 0 && push(f);
  }
  switch (static_cast<JsonKind>(kind)) {
    case JsonKind::kObject: f.kind = Kind::kObject; return push(f);
    case JsonKind::kArray: f.kind = Kind::kArray; return push(f);
    case JsonKind::kString: f.kind = Kind::kString; return push(f);
    case JsonKind::kNumber: f.kind = Kind::kNumber; return push(f);
    default: return true;  // true, false, null: JsonState spells them out
  }
}

bool SchemaState::in_key(Frame& f, unsigned char c) {
  // f.cand: the properties whose names start with the key read so far. A key that is a
  // property's name takes that property's schema, and only where it may still be written (not
  // yet, and its value can end within the depth limit); any other key is an extra property.
  const SchemaNode& n = node(f.node);
  if (lex_.mode_ == Mode::kColon) {  // the key's closing quote
    f.in_key = false;
    for (std::size_t i = 0; i < n.properties.size(); ++i) {
      const std::uint64_t bit = std::uint64_t{1} << i;
      if ((f.cand & bit) && n.properties[i].key.size() == f.pos) {
        if ((f.seen & bit) || !fits(n.properties[i].node)) return false;
        f.seen |= bit;
        f.value = n.properties[i].node;
        return true;
      }
    }
    f.value = n.additional;
    return fits(n.additional);
  }
  std::uint64_t cand = 0;
  for (std::size_t i = 0; i < n.properties.size(); ++i) {
    const std::string& key = n.properties[i].key;
    if ((f.cand >> i & 1u) && f.pos < key.size() && static_cast<unsigned char>(key[f.pos]) == c)
      cand |= std::uint64_t{1} << i;
  }
  f.cand = cand;
  ++f.pos;
  return fitting_properties(n, cand & ~f.seen) != 0 || fits(n.additional);
}

bool SchemaState::fits(int value) const {
  return value >= 0 && node(value).least <= JsonState::kMaxDepth - lex_.depth_;
}

std::uint64_t SchemaState::fitting_properties(const SchemaNode& n, std::uint64_t among) const {
  std::uint64_t out = 0;
  for (std::uint64_t left = among; left != 0; left &= left - 1) {
    const int i = std::countr_zero(left);
    if (fits(n.properties[static_cast<std::size_t>(i)].node)) out |= std::uint64_t{1} << i;
  }
  return out;
}

bool SchemaState::in_container(unsigned char c, Mode before, std::uint8_t depth) {
  Frame& f = top();
  const SchemaNode& n = node(f.node);
  if (f.kind == Kind::kObject && f.in_key) return in_key(f, c);
  switch (before) {
    case Mode::kValue: case Mode::kArrayFirst: case Mode::kObjectFirstKey: case Mode::kObjectKey:
    case Mode::kColon: case Mode::kAfterValue:
      if (is_space(c)) return true;
      break;
    default: return true;  // inside a literal: JsonState spells it
  }
  if (f.kind == Kind::kObject) {
    // Another key only where one is left whose value can still end within the depth limit
    // (values start at the object's own depth).
    const auto room = [&] {
      return fitting_properties(n, first_bits(n.properties.size()) & ~f.seen) != 0 || fits(n.additional);
    };
    switch (before) {
      case Mode::kObjectFirstKey: case Mode::kObjectKey:
        if (c == '"') {
          f.in_key = true;
          f.pos = 0;
          f.cand = first_bits(n.properties.size());
          return room();
        }
        [[fallthrough]];
      case Mode::kAfterValue:
        if (c == ',') return room();
        if (c == '}') {
          if (n.required & ~f.seen) return false;
          --depth_;
          return true;
        }
        return false;
      case Mode::kColon: return true;
      case Mode::kValue: return begin_value(f.value, c, depth);
      default: return false;
    }
  }
  // An array.
  switch (before) {
    case Mode::kArrayFirst:
      if (c == ']') {
        if (n.min_items > 0) return false;
        --depth_;
        return true;
      }
      [[fallthrough]];
    case Mode::kValue:
      if (n.max_items >= 0 && f.count >= n.max_items) return false;
      ++f.count;
      return begin_value(n.items, c, depth);
    case Mode::kAfterValue:
      if (c == ',') return (n.max_items < 0 || f.count < n.max_items) && fits(n.items);
      if (c == ']') {
        if (f.count < n.min_items) return false;
        --depth_;
        return true;
      }
      return false;
    default: return false;
  }
}

bool SchemaState::feed(unsigned char c) {
  const Mode before = lex_.mode_;
  const std::uint8_t depth = lex_.depth_;
  const bool char_start = before == Mode::kString && lex_.utf8_left_ == 0;
  if (!lex_.feed(c)) return false;
  if (depth_ == 0) return before != Mode::kStart || c != '{' || begin_value(0, c, depth);
  Frame& f = top();
  const SchemaNode& n = node(f.node);
  switch (f.kind) {
    case Kind::kObject: case Kind::kArray: return in_container(c, before, depth);
    case Kind::kString:
      if (char_start) {
        if (c == '"') {
          if (f.count < n.min_length) return false;
          --depth_;
          return true;
        }
        if (n.max_length >= 0 && f.count >= n.max_length) return false;
        ++f.count;
      }
      return true;
    case Kind::kNumber:
      if (lex_.mode_ == Mode::kNumber) return !(n.integer && (c == '.' || c == 'e' || c == 'E'));
      // The number ended before this byte, which belongs to the container.
      --depth_;
      return in_container(c, Mode::kAfterValue, depth);
    case Kind::kEnum: case Kind::kAny: {
      const auto complete_value = [&] {
        if (f.kind == Kind::kAny) return true;
        for (std::size_t i = 0; i < n.values.size(); ++i)
          if ((f.cand >> i & 1u) && n.values[i].size() == f.pos) return true;
        return false;
      };
      if (before == Mode::kNumber && depth == f.depth && lex_.mode_ != Mode::kNumber) {
        if (!complete_value()) return false;
        --depth_;
        return in_container(c, Mode::kAfterValue, depth);
      }
      if (f.kind == Kind::kEnum) {
        std::uint64_t cand = 0;
        for (std::size_t i = 0; i < n.values.size(); ++i)
          if ((f.cand >> i & 1u) && f.pos < n.values[i].size() && static_cast<unsigned char>(n.values[i][f.pos]) == c)
            cand |= std::uint64_t{1} << i;
        f.cand = cand;
        ++f.pos;
        if (!cand) return false;
      }
      if (lex_.mode_ == Mode::kAfterValue && lex_.depth_ == f.depth) {
        if (!complete_value()) return false;
        --depth_;
      }
      return true;
    }
  }
  return false;
}

bool SchemaState::feed(std::string_view bytes) {
  for (const char c : bytes)
    if (!feed(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace batchlm::local_engine
