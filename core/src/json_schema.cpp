#include "batchlm/core/json_schema.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <string_view>

namespace batchlm {

namespace {

using nlohmann::json;

constexpr const char* kKindNames[kJsonKinds] = {"objects", "arrays", "strings", "numbers", "booleans", "null"};

// Keywords that describe a value without restricting it.
bool annotation(std::string_view k) {
  static constexpr std::string_view kAnnotations[] = {
      "title",       "description", "default",         "examples",         "$schema", "$id",
      "$comment",    "deprecated",  "readOnly",        "writeOnly",        "format",  "contentEncoding",
      "contentMediaType", "$defs",  "definitions",     "discriminator",    "$anchor"};
  for (const std::string_view a : kAnnotations)
    if (k == a) return true;
  return false;
}

constexpr std::string_view kObjectWords[] = {"properties", "required", "additionalProperties"};
constexpr std::string_view kArrayWords[] = {"items", "minItems", "maxItems"};
constexpr std::string_view kStringWords[] = {"minLength", "maxLength"};

template <std::size_t N>
bool among(std::string_view k, const std::string_view (&words)[N]) {
  for (const std::string_view w : words)
    if (k == w) return true;
  return false;
}

// A JSON pointer's reference token.
std::string escape_token(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (c == '~') out += "~0";
    else if (c == '/') out += "~1";
    else out += c;
  }
  return out;
}

std::string excerpt(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

int kind_of_value(const json& v) {
  switch (v.type()) {
    case json::value_t::object: return static_cast<int>(JsonKind::kObject);
    case json::value_t::array: return static_cast<int>(JsonKind::kArray);
    case json::value_t::string: return static_cast<int>(JsonKind::kString);
    case json::value_t::boolean: return static_cast<int>(JsonKind::kBoolean);
    case json::value_t::null: return static_cast<int>(JsonKind::kNull);
    default: return static_cast<int>(JsonKind::kNumber);
  }
}

bool integral(const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return true;
  return v.is_number_float() && std::isfinite(v.get<double>()) && v.get<double>() == std::floor(v.get<double>());
}

class Compiler {
 public:
  explicit Compiler(const json& root) : root_(root) {}

  JsonSchema run() {
    const int root = new_node("");
    refs_[""] = root;
    fill(root, root_, "");
    for (int i = 0; i < static_cast<int>(out_.nodes.size()); ++i) resolve(i);
    nesting();
    const auto& by = out_.nodes[0].by_kind;
    for (int k = 0; k < kJsonKinds; ++k)
      if (k != static_cast<int>(JsonKind::kObject) && by[static_cast<std::size_t>(k)] >= 0)
        throw SchemaError("", std::string("the root must admit objects only (\"type\": \"object\"), as OpenAI's "
                                          "structured outputs ask; this one admits ") +
                                  kKindNames[k]);
    if (by[static_cast<std::size_t>(JsonKind::kObject)] < 0)
      throw SchemaError("", "admits no object that ends (a required property refers back to the object it is in, "
                            "or the nesting it needs is deeper than 64)");
    return std::move(out_);
  }

 private:
  enum class Form : std::uint8_t { kTyped, kAny, kRef, kAnyOf };
  struct Extra {
    Form form = Form::kTyped;
    std::uint8_t kinds = 0;  // kTyped: the kinds it admits, a bit each
    int target = -1;         // kRef
    std::vector<int> branches;  // kAnyOf
    std::string where;
    std::uint8_t resolving = 0;  // 0 not yet, 1 under way, 2 done
  };

  int new_node(std::string where) {
    if (out_.nodes.size() >= kMaxSchemaNodes)
      throw SchemaError(where, "the schema has more than " + std::to_string(kMaxSchemaNodes) + " parts");
    out_.nodes.emplace_back();
    extra_.push_back(Extra{});
    extra_.back().where = std::move(where);
    return static_cast<int>(out_.nodes.size()) - 1;
  }

  int compile(const json& s, const std::string& where) {
    const int id = new_node(where);
    fill(id, s, where);
    return id;
  }

  int any_node() {
    if (any_ < 0) {
      any_ = new_node("");
      out_.nodes[static_cast<std::size_t>(any_)].any = true;
      extra_[static_cast<std::size_t>(any_)].form = Form::kAny;
    }
    return any_;
  }

  static std::int64_t count(const json& v, const std::string& where) {
    if (!integral(v) || v.get<double>() < 0 || v.get<double>() > 1e9)
      throw SchemaError(where, "expected a whole number from 0 to 1000000000, not " + excerpt(v));
    return static_cast<std::int64_t>(v.get<double>());
  }

  int ref(const json& v, const std::string& where) {
    if (!v.is_string()) throw SchemaError(where, "expected a string, not " + excerpt(v));
    const std::string& r = v.get_ref<const std::string&>();
    if (r.empty() || r[0] != '#' || (r.size() > 1 && r[1] != '/'))
      throw SchemaError(where, "only references within the schema (\"#\", \"#/$defs/Name\") are followed, not '" +
                                   r.substr(0, 80) + "'");
    const std::string pointer = r.substr(1);
    if (const auto it = refs_.find(pointer); it != refs_.end()) return it->second;
    const json* target = nullptr;
    try {
      const json::json_pointer p(pointer);
      if (root_.contains(p)) target = &root_.at(p);
    } catch (const json::exception&) {
    }
    if (!target) throw SchemaError(where, "'" + r.substr(0, 80) + "' points to nothing in the schema");
    const int id = new_node(pointer);
    refs_[pointer] = id;
    fill(id, *target, pointer);
    return id;
  }

  void fill(int id, const json& s, const std::string& where) {
    const auto node = [&]() -> SchemaNode& { return out_.nodes[static_cast<std::size_t>(id)]; };
    const auto extra = [&]() -> Extra& { return extra_[static_cast<std::size_t>(id)]; };
    if (s.is_boolean()) {
      if (!s.get<bool>()) throw SchemaError(where, "the schema false admits no value");
      node().any = true;
      extra().form = Form::kAny;
      return;
    }
    if (!s.is_object()) throw SchemaError(where, "a schema is an object or a boolean, not " + excerpt(s));
    bool object_words = false, array_words = false, string_words = false, restricts = false;
    for (const auto& [k, v] : s.items()) {
      if (annotation(k)) continue;
      const std::string at = where + "/" + escape_token(k);
      if (among(k, kObjectWords)) object_words = true;
      else if (among(k, kArrayWords)) array_words = true;
      else if (among(k, kStringWords)) string_words = true;
      else if (k == "uniqueItems" && v == false) continue;
      else if (k != "type" && k != "enum" && k != "const" && k != "nullable" && k != "$ref" && k != "anyOf" &&
               k != "oneOf")
        throw SchemaError(at, "'" + k.substr(0, 40) +
                                  "' is not supported by the embedded engine's structured outputs (it follows "
                                  "type, enum, const, properties, required, additionalProperties, items, minItems, "
                                  "maxItems, minLength, maxLength, anyOf, oneOf and $ref)");
      if (k != "$ref") restricts = true;
    }
    if (const auto r = s.find("$ref"); r != s.end()) {
      if (restricts)
        throw SchemaError(where, "keywords next to $ref are not followed; move them into the schema it refers to");
      const int target = ref(*r, where + "/$ref");
      extra().form = Form::kRef;
      extra().target = target;
      return;
    }
    for (const char* word : {"anyOf", "oneOf"}) {
      const auto a = s.find(word);
      if (a == s.end()) continue;
      const std::string at = where + "/" + word;
      if (!a->is_array() || a->empty()) throw SchemaError(at, "expected a non-empty array of schemas");
      for (const auto& [k, v] : s.items())
        if (k != word && !annotation(k))
          throw SchemaError(where + "/" + escape_token(k), "'" + k + "' next to " + word +
                                                               " is not followed; write it in each branch");
      std::vector<int> branches;
      for (std::size_t i = 0; i < a->size(); ++i) branches.push_back(compile((*a)[i], at + "/" + std::to_string(i)));
      extra().form = Form::kAnyOf;
      extra().branches = std::move(branches);
      return;
    }

    // The kinds it admits: from `type`, else from the keywords it has.
    std::uint8_t kinds = 0;
    bool integer = false;
    const auto t = s.find("type");
    if (t != s.end()) {
      const std::string at = where + "/type";
      bool named_integer = false, named_number = false;
      const auto add = [&](const json& name) {
        static constexpr std::pair<std::string_view, JsonKind> kTypes[] = {
            {"object", JsonKind::kObject}, {"array", JsonKind::kArray},     {"string", JsonKind::kString},
            {"number", JsonKind::kNumber}, {"integer", JsonKind::kNumber},  {"boolean", JsonKind::kBoolean},
            {"null", JsonKind::kNull}};
        if (name.is_string())
          for (const auto& [n, k] : kTypes)
            if (name.get_ref<const std::string&>() == n) {
              kinds = static_cast<std::uint8_t>(kinds | (1u << static_cast<int>(k)));
              if (n == "integer") named_integer = true;
              if (n == "number") named_number = true;
              return;
            }
        throw SchemaError(at, "expected object, array, string, number, integer, boolean or null, not " + excerpt(name));
      };
      if (t->is_array()) {
        if (t->empty()) throw SchemaError(at, "an empty list of types admits no value");
        for (const auto& name : *t) add(name);
      } else {
        add(*t);
      }
      integer = named_integer && !named_number;
    } else {
      if (object_words) kinds |= 1u << static_cast<int>(JsonKind::kObject);
      if (array_words) kinds |= 1u << static_cast<int>(JsonKind::kArray);
      if (string_words) kinds |= 1u << static_cast<int>(JsonKind::kString);
    }
    if (const auto n = s.find("nullable"); n != s.end()) {
      if (!n->is_boolean()) throw SchemaError(where + "/nullable", "expected true or false, not " + excerpt(*n));
      if (n->get<bool>() && kinds) kinds |= 1u << static_cast<int>(JsonKind::kNull);
    }

    // enum and const: the value is one of these.
    const auto e = s.find("enum");
    const auto c = s.find("const");
    if (e != s.end() || c != s.end()) {
      if (e != s.end() && c != s.end()) throw SchemaError(where, "both enum and const; give one");
      const std::string at = where + (e != s.end() ? "/enum" : "/const");
      json values = e != s.end() ? *e : json::array({*c});
      if (!values.is_array()) throw SchemaError(at, "expected an array of values, not " + excerpt(values));
      if (values.empty()) throw SchemaError(at, "an empty enum admits no value");
      if (values.size() > kMaxSchemaValues)
        throw SchemaError(at, "has " + std::to_string(values.size()) + " values; at most " +
                                  std::to_string(kMaxSchemaValues) + " are followed");
      std::uint8_t enum_kinds = 0;
      node().has_enum = true;
      for (std::size_t i = 0; i < values.size(); ++i) {
        const json& v = values[i];
        const int k = kind_of_value(v);
        if (kinds && (!(kinds & (1u << k)) || (k == static_cast<int>(JsonKind::kNumber) && integer && !integral(v))))
          throw SchemaError(e != s.end() ? at + "/" + std::to_string(i) : at,
                            "the value " + excerpt(v) + " is not of the type the schema gives");
        enum_kinds = static_cast<std::uint8_t>(enum_kinds | (1u << k));
        std::string text = v.dump();
        for (const std::string& seen : node().values)
          if (seen == text) text.clear();
        if (!text.empty()) node().values.push_back(std::move(text));
      }
      kinds = enum_kinds;
    }
    if (!kinds) {  // annotations only
      node().any = true;
      extra().form = Form::kAny;
      return;
    }
    extra().kinds = kinds;
    node().integer = integer;
    if (node().has_enum) return;

    if (kinds & (1u << static_cast<int>(JsonKind::kObject))) {
      const auto p = s.find("properties");
      if (p != s.end()) {
        const std::string at = where + "/properties";
        if (!p->is_object()) throw SchemaError(at, "expected an object of schemas, not " + excerpt(*p));
        if (p->size() > kMaxSchemaProperties)
          throw SchemaError(at, "has " + std::to_string(p->size()) + " properties; at most " +
                                    std::to_string(kMaxSchemaProperties) + " per object are followed");
        for (const auto& [name, sub] : p->items()) {
          std::string key = json(name).dump();
          key = key.substr(1, key.size() - 2);
          const int child = compile(sub, at + "/" + escape_token(name));
          node().properties.push_back({std::move(key), child});
        }
      }
      const auto r = s.find("required");
      if (r != s.end()) {
        const std::string at = where + "/required";
        if (!r->is_array()) throw SchemaError(at, "expected an array of property names, not " + excerpt(*r));
        for (std::size_t i = 0; i < r->size(); ++i) {
          const json& name = (*r)[i];
          if (!name.is_string()) throw SchemaError(at + "/" + std::to_string(i), "expected a property name, not " + excerpt(name));
          std::string key = name.dump();
          key = key.substr(1, key.size() - 2);
          std::size_t j = 0;
          while (j < node().properties.size() && node().properties[j].key != key) ++j;
          if (j == node().properties.size())
            throw SchemaError(at + "/" + std::to_string(i),
                              "'" + name.get<std::string>().substr(0, 60) +
                                  "' is required but not among the properties; the embedded engine requires only "
                                  "properties whose schema it is given");
          node().required |= std::uint64_t{1} << j;
        }
      }
      const auto a = s.find("additionalProperties");
      if (a == s.end()) {
        if (node().properties.empty()) node().additional = any_node();
      } else if (*a == false) {
        node().additional = -1;
      } else {
        const int extra_node = *a == true ? any_node() : compile(*a, where + "/additionalProperties");
        node().additional = extra_node;
      }
    }
    if (kinds & (1u << static_cast<int>(JsonKind::kArray))) {
      const auto it = s.find("items");
      if (it != s.end() && it->is_array())
        throw SchemaError(where + "/items", "tuples (items as an array of schemas) are not supported");
      const int items = it == s.end() ? any_node() : compile(*it, where + "/items");
      node().items = items;
      if (const auto m = s.find("minItems"); m != s.end()) node().min_items = count(*m, where + "/minItems");
      if (const auto m = s.find("maxItems"); m != s.end()) node().max_items = count(*m, where + "/maxItems");
      if (node().max_items >= 0 && node().max_items < node().min_items)
        throw SchemaError(where + "/maxItems", "maxItems is below minItems: no array fits");
    }
    if (kinds & (1u << static_cast<int>(JsonKind::kString))) {
      if (const auto m = s.find("minLength"); m != s.end()) node().min_length = count(*m, where + "/minLength");
      if (const auto m = s.find("maxLength"); m != s.end()) node().max_length = count(*m, where + "/maxLength");
      if (node().max_length >= 0 && node().max_length < node().min_length)
        throw SchemaError(where + "/maxLength", "maxLength is below minLength: no string fits");
    }
  }

  static int depth_of(const json& v) {
    int d = 0;
    if (v.is_structured())
      for (const auto& child : v) d = std::max(d, depth_of(child));
    return v.is_structured() ? d + 1 : d;
  }

  // SchemaNode::need and least, by relaxation from "never" (recursion resolves in a few
  // passes); then what can never end is pruned: kinds from by_kind, optional properties, an
  // extra property's schema, array items (the array then stays empty).
  void nesting() {
    using N = SchemaNode;
    std::vector<N>& nodes = out_.nodes;
    const auto least = [&](int id) {
      int best = N::kNever;
      const N& n = nodes[static_cast<std::size_t>(id)];
      for (int k = 0; k < kJsonKinds; ++k) {
        const int t = n.by_kind[static_cast<std::size_t>(k)];
        if (t >= 0) best = std::min(best, nodes[static_cast<std::size_t>(t)].need[static_cast<std::size_t>(k)]);
      }
      return best;
    };
    // Any value and enum values need what they need whatever the other nodes do: set once,
    // for the kinds the node takes itself.
    for (std::size_t id = 0; id < nodes.size(); ++id) {
      N& n = nodes[id];
      const auto own = [&](int k) { return n.by_kind[static_cast<std::size_t>(k)] == static_cast<int>(id); };
      if (n.any) {
        for (int k = 0; k < kJsonKinds; ++k)
          if (own(k)) n.need[static_cast<std::size_t>(k)] = k == static_cast<int>(JsonKind::kObject) || k == static_cast<int>(JsonKind::kArray);
      } else if (n.has_enum) {
        for (const std::string& text : n.values) {
          const json value = json::parse(text);
          const int k = kind_of_value(value);
          if (own(k)) n.need[static_cast<std::size_t>(k)] = std::min(n.need[static_cast<std::size_t>(k)], depth_of(value));
        }
      }
    }
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t id = 0; id < nodes.size(); ++id) {
        N& n = nodes[id];
        if (n.any || n.has_enum) continue;
        for (int k = 0; k < kJsonKinds; ++k) {
          if (n.by_kind[static_cast<std::size_t>(k)] != static_cast<int>(id)) continue;  // not its own kind
          int v = 0;
          if (k == static_cast<int>(JsonKind::kObject)) {
            v = 1;
            for (std::size_t i = 0; i < n.properties.size(); ++i)
              if (n.required >> i & 1u) v = std::max(v, std::min(N::kNever, 1 + least(n.properties[i].node)));
          } else if (k == static_cast<int>(JsonKind::kArray)) {
            v = n.min_items > 0 ? std::min(N::kNever, 1 + least(n.items)) : 1;
          }
          if (v < n.need[static_cast<std::size_t>(k)]) {
            n.need[static_cast<std::size_t>(k)] = v;
            changed = true;
          }
        }
      }
    }
    std::vector<std::array<int, kJsonKinds>> need(nodes.size());
    for (std::size_t id = 0; id < nodes.size(); ++id)
      for (int k = 0; k < kJsonKinds; ++k) {
        const int t = nodes[id].by_kind[static_cast<std::size_t>(k)];
        need[id][static_cast<std::size_t>(k)] = t >= 0 ? nodes[static_cast<std::size_t>(t)].need[static_cast<std::size_t>(k)] : N::kNever;
      }
    for (std::size_t id = 0; id < nodes.size(); ++id) {
      N& n = nodes[id];
      n.need = need[id];
      n.least = N::kNever;
      for (int k = 0; k < kJsonKinds; ++k) {
        if (n.need[static_cast<std::size_t>(k)] >= N::kNever) n.by_kind[static_cast<std::size_t>(k)] = -1;
        n.least = std::min(n.least, n.need[static_cast<std::size_t>(k)]);
      }
    }
    for (N& n : nodes) {
      // Required properties that never end leave the object without a kind; it is never entered.
      std::vector<N::Property> kept;
      std::uint64_t required = 0;
      for (std::size_t i = 0; i < n.properties.size(); ++i) {
        if (nodes[static_cast<std::size_t>(n.properties[i].node)].least >= N::kNever && !(n.required >> i & 1u)) continue;
        if (n.required >> i & 1u) required |= std::uint64_t{1} << kept.size();
        kept.push_back(std::move(n.properties[i]));
      }
      n.properties = std::move(kept);
      n.required = required;
      if (n.additional >= 0 && nodes[static_cast<std::size_t>(n.additional)].least >= N::kNever) n.additional = -1;
      if (n.items >= 0 && nodes[static_cast<std::size_t>(n.items)].least >= N::kNever) n.max_items = 0;
    }
  }

  // Which node takes a value of each kind, through references and anyOf branches.
  void resolve(int id) {
    Extra& x = extra_[static_cast<std::size_t>(id)];
    if (x.resolving == 2) return;
    if (x.resolving == 1)
      throw SchemaError(x.where, "refers back to itself through $ref or anyOf without a type in between");
    x.resolving = 1;
    std::array<int, kJsonKinds> by{-1, -1, -1, -1, -1, -1};
    switch (x.form) {
      case Form::kAny: by.fill(id); break;
      case Form::kTyped:
        for (int k = 0; k < kJsonKinds; ++k)
          if (x.kinds & (1u << k)) by[static_cast<std::size_t>(k)] = id;
        break;
      case Form::kRef:
        resolve(x.target);
        by = out_.nodes[static_cast<std::size_t>(x.target)].by_kind;
        break;
      case Form::kAnyOf: {
        const std::vector<int> branches = x.branches;
        for (const int b : branches) {
          resolve(b);
          const auto& bb = out_.nodes[static_cast<std::size_t>(b)].by_kind;
          for (int k = 0; k < kJsonKinds; ++k) {
            const int n = bb[static_cast<std::size_t>(k)];
            if (n < 0) continue;
            int& slot = by[static_cast<std::size_t>(k)];
            if (slot >= 0 && slot != n)
              throw SchemaError(extra_[static_cast<std::size_t>(id)].where,
                                std::string("two branches both admit ") + kKindNames[k] +
                                    "; the embedded engine tells branches apart by the JSON type of the value (an "
                                    "object, an array, a string, a number, a boolean or null)");
            slot = n;
          }
        }
        break;
      }
    }
    out_.nodes[static_cast<std::size_t>(id)].by_kind = by;
    extra_[static_cast<std::size_t>(id)].resolving = 2;
  }

  const json& root_;
  JsonSchema out_;
  std::vector<Extra> extra_;
  std::map<std::string, int> refs_;
  int any_ = -1;
};

}  // namespace

int json_kind_of(unsigned char c) {
  switch (c) {
    case '{': return static_cast<int>(JsonKind::kObject);
    case '[': return static_cast<int>(JsonKind::kArray);
    case '"': return static_cast<int>(JsonKind::kString);
    case 't': case 'f': return static_cast<int>(JsonKind::kBoolean);
    case 'n': return static_cast<int>(JsonKind::kNull);
    default: return c == '-' || (c >= '0' && c <= '9') ? static_cast<int>(JsonKind::kNumber) : -1;
  }
}

JsonSchema compile_json_schema(const json& schema) { return Compiler(schema).run(); }

}  // namespace batchlm
