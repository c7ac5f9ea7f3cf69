// Structured outputs: compile_json_schema (core/src/json_schema.cpp) on an arbitrary JSON
// schema, then SchemaState (local_engine/sampling/json_schema.cpp) on an arbitrary text.
//
// Input: the schema's JSON text up to the first NUL byte, then the text to follow.
//
// Promised: a schema compiles or is refused with SchemaError saying where ("at ..."), never a
// crash, a hang or another exception. Checked: the state never traps the text: wherever it has
// taken the text so far and the root object is not closed, some byte continues it; a text it
// takes whole and calls complete is one JSON object, as nlohmann's parser reads it.

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "batchlm/core/json_schema.hpp"
#include "batchlm/local_engine/json_schema.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::local_engine;

namespace {

bool continues(const SchemaState& state) {
  for (int c = 0; c < 256; ++c) {
    SchemaState s = state;
    if (s.feed(static_cast<unsigned char>(c))) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const std::string_view schema_text = input.until('\0');
  const std::string_view text = input.rest();
  const nlohmann::json schema = nlohmann::json::parse(schema_text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return 0;
  JsonSchema compiled;
  try {
    compiled = compile_json_schema(schema);
  } catch (const SchemaError& e) {
    FUZZ_CHECK(std::string_view(e.what()).starts_with("at "), std::string("unexpected message: ") + e.what());
    return 0;
  }
  FUZZ_CHECK(!compiled.nodes.empty(), "a compiled schema without nodes");

  SchemaState state(compiled);
  std::size_t taken = 0;
  // The no-trap check feeds 256 bytes per position: at every one of the first 64, then at the end.
  for (; taken < text.size(); ++taken) {
    if (!state.complete() && taken < 64) FUZZ_CHECK(continues(state), "trapped after " + std::string(text.substr(0, taken)));
    SchemaState next = state;
    if (!next.feed(static_cast<unsigned char>(text[taken]))) break;
    state = next;
  }
  if (!state.complete()) FUZZ_CHECK(continues(state), "trapped after " + std::string(text.substr(0, taken)));
  FUZZ_CHECK(SchemaState(compiled).accepts(text.substr(0, taken)), "fed whole, the prefix it took byte by byte is refused");
  if (taken == text.size() && state.complete()) {
    try {
      const nlohmann::json value = nlohmann::json::parse(text);
      FUZZ_CHECK(value.is_object(), "a complete text that is not an object: " + std::string(text));
    } catch (const nlohmann::json::out_of_range&) {
      // A number past a double's range: valid JSON the parser will not hold.
    } catch (const nlohmann::json::exception& e) {
      FUZZ_CHECK(false, std::string("a complete text the parser refuses (") + e.what() + "): " + std::string(text));
    }
  }
  return 0;
}
