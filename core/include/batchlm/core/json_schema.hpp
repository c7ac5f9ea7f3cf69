#pragma once
// Structured outputs (OpenAI's response_format {"type": "json_schema"}): the part of JSON Schema
// the embedded engine can hold its output to, compiled into a graph of nodes that the engine's
// SchemaState (local_engine/json_schema.hpp) follows byte by byte while it samples.
//
// What it follows: `type` (one or a list), `enum` and `const` (values written as compact JSON),
// objects (`properties`, `required`, `additionalProperties`), arrays (`items`, `minItems`,
// `maxItems`), strings (`minLength`, `maxLength`, counted in code points), integers (written
// without fraction or exponent), `anyOf`/`oneOf` whose branches take different JSON types (a
// string or null, an object or an array, ...), `nullable`, and `$ref` to the schema's own
// `$defs`/`definitions` (recursion included). Annotations (`title`, `description`, `default`,
// `examples`, `format`, ...) are read and ignored. Anything else that restricts values
// (`pattern`, `minimum`, `allOf`, ...) is refused with the place it is at, rather than followed
// loosely.
//
// Where the schema leaves it open, the output is one of the values it admits: properties come in
// any order, each at most once; without `additionalProperties`, an object with `properties`
// holds only those (an object without them holds any), as OpenAI's strict mode asks.

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace batchlm {

// The JSON types a value starts as, told apart by its first byte.
enum class JsonKind : std::uint8_t { kObject, kArray, kString, kNumber, kBoolean, kNull };
inline constexpr int kJsonKinds = 6;

struct SchemaNode {
  // Any JSON value at all ({}, true, or a schema of annotations only).
  bool any = false;
  // The value is one of these, each as compact JSON text (enum, const).
  bool has_enum = false;
  std::vector<std::string> values;
  bool integer = false;  // a number must be an integer
  // Objects.
  struct Property {
    std::string key;  // the name as it appears between the quotes (JSON-escaped)
    int node = -1;
  };
  std::vector<Property> properties;
  std::uint64_t required = 0;  // bit i: properties[i] is required
  int additional = -1;         // the schema of other properties' values; -1: none allowed
  // Arrays.
  int items = -1;
  std::int64_t min_items = 0, max_items = -1;  // -1: no limit
  // Strings.
  std::int64_t min_length = 0, max_length = -1;
  // Which node a value of each kind follows (this one, or an anyOf branch's); -1 where the
  // schema admits no value of that kind, or none that ends (a required property that refers
  // back to its own object).
  std::array<int, kJsonKinds> by_kind{-1, -1, -1, -1, -1, -1};
  // The least nesting a value of each kind needs (containers, its own included: 0 for a
  // string, 1 for {}, 2 for {"a": []}), kNever where there is none; and the least of these.
  // A value may start only where it can end within the recognizer's depth limit.
  static constexpr int kNever = 1 << 20;
  std::array<int, kJsonKinds> need{kNever, kNever, kNever, kNever, kNever, kNever};
  int least = kNever;
};

struct JsonSchema {
  std::vector<SchemaNode> nodes;  // nodes[0]: the root, which admits objects only
};

// A schema the engine cannot hold its output to, with where (a JSON pointer into the schema).
class SchemaError : public std::runtime_error {
 public:
  SchemaError(std::string where, const std::string& what)
      : std::runtime_error((where.empty() ? std::string("at the root") : "at " + where) + ": " + what),
        where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

// Limits that keep every state small: properties per object, values per enum, nodes per schema.
inline constexpr std::size_t kMaxSchemaProperties = 64;
inline constexpr std::size_t kMaxSchemaValues = 64;
inline constexpr std::size_t kMaxSchemaNodes = 4096;

// Compiles `schema`; throws SchemaError for one it cannot follow.
JsonSchema compile_json_schema(const nlohmann::json& schema);

// The JSON kind a value starting with byte `c` has, or -1 when no value starts with it.
int json_kind_of(unsigned char c);

}  // namespace batchlm
