#pragma once
// Structured outputs: SchemaState follows a compiled JSON schema (core/json_schema.hpp) byte by
// byte on top of JsonState's reading of the text, so JsonMask can mask every token that would
// leave the schema: a key that is no property (or one already written), a value of a type the
// schema does not admit, a character past maxLength, an item past maxItems, a closing brace
// before the required properties, a value outside an enum. Generation ends when the root object
// closes, as in JSON mode.

#include <array>
#include <cstdint>
#include <string_view>

#include "batchlm/core/json_schema.hpp"
#include "batchlm/local_engine/json_mode.hpp"

namespace batchlm::local_engine {

class SchemaState {
 public:
  // `schema` must outlive the state and its copies.
  explicit SchemaState(const JsonSchema& schema) : schema_(&schema) {}
  // Copies only the frames in use (the mask copies a state for every token it tries).
  SchemaState(const SchemaState& other) { *this = other; }
  SchemaState& operator=(const SchemaState& other);

  // Takes one byte; false (the state then unspecified) when it cannot continue a text the
  // schema admits.
  bool feed(unsigned char c);
  bool feed(std::string_view bytes);
  bool accepts(std::string_view bytes) const {
    SchemaState s = *this;
    return s.feed(bytes);
  }
  // The root object has closed.
  bool complete() const { return lex_.complete(); }
  // Between characters of a string whose content the schema leaves open but for its length (no
  // enum): plain text continues it, up to plain_room() characters.
  bool in_plain_string() const;
  std::int64_t plain_room() const {
    const Frame& f = frames_[static_cast<std::size_t>(depth_ - 1)];
    const std::int64_t most = f.kind == Kind::kString ? node(f.node).max_length : -1;
    return most < 0 ? INT64_MAX : most - f.count;
  }

 private:
  enum class Kind : std::uint8_t { kObject, kArray, kString, kNumber, kEnum, kAny };
  // One open value. Literals (true, false, null) need none: JsonState spells them.
  struct Frame {
    Kind kind;
    bool in_key;          // kObject: reading a key
    std::uint8_t depth;   // kEnum, kAny: JsonState's depth where the value started
    std::uint16_t pos;    // kObject: key bytes read; kEnum: value bytes read
    std::int32_t node;
    std::int32_t value;   // kObject: the node of the value after the key just read
    std::int64_t count;   // kArray: items begun; kString: characters
    std::uint64_t seen;   // kObject: the properties written
    std::uint64_t cand;   // kObject: the properties the key read so far can be; kEnum: the values
  };
  static constexpr int kMaxFrames = JsonState::kMaxDepth + 1;
  using Mode = JsonState::Mode;

  const SchemaNode& node(int i) const { return schema_->nodes[static_cast<std::size_t>(i)]; }
  Frame& top() { return frames_[static_cast<std::size_t>(depth_ - 1)]; }
  bool push(const Frame& f);
  // The first byte `c` of a value that follows `node`, read by JsonState at depth `depth`.
  bool begin_value(int node, unsigned char c, std::uint8_t depth);
  // Byte `c` where the top frame is an object or an array and JsonState read it in mode `before`.
  bool in_container(unsigned char c, Mode before, std::uint8_t depth);
  bool in_key(Frame& f, unsigned char c);
  // Whether a value of `node` starting at JsonState's depth now can end within its depth limit.
  bool fits(int node) const;
  // The properties among `among` (bit i: n.properties[i]) whose values fit.
  std::uint64_t fitting_properties(const SchemaNode& n, std::uint64_t among) const;

  JsonState lex_;
  const JsonSchema* schema_ = nullptr;
  int depth_ = 0;
  std::array<Frame, kMaxFrames> frames_;
};

}  // namespace batchlm::local_engine
