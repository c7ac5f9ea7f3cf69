// The SSE parser (client/src/sse.cpp) on arbitrary streams, fed in arbitrary chunks.
//
// Input: one byte choosing the limits (small ones, so that the limits are reached), one byte
// seeding the chunk sizes, then the stream.
//
// Checked:
//   - the events, the final status, retry_ms and has_unterminated_event are the same whether
//     the stream arrives in one piece, one byte at a time or in random chunks;
//   - without a limit reached, the events are those of a straightforward reading of the
//     WHATWG rules (reference_events below), written without the parser's buffering;
//   - no event's data exceeds max_event_bytes; no field holds a line end.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/client/sse.hpp"
#include "fuzz_support.hpp"

using batchlm::client::SseEvent;
using batchlm::client::SseLimits;
using batchlm::client::SseParser;

namespace {

struct Result {
  std::vector<SseEvent> events;
  SseParser::Status status = SseParser::Status::Ok;
  std::optional<long long> retry_ms;
  bool unterminated = false;
};

bool same_events(const std::vector<SseEvent>& a, const std::vector<SseEvent>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].type != b[i].type || a[i].data != b[i].data || a[i].last_event_id != b[i].last_event_id) return false;
  }
  return true;
}

std::string describe(const Result& r) {
  std::string out = "status " + std::to_string(static_cast<int>(r.status)) + ", " +
                    std::to_string(r.events.size()) + " events";
  for (const SseEvent& e : r.events) out += " [" + e.type + "|" + e.data + "|" + e.last_event_id + "]";
  return out;
}

// Feeds `stream` in chunks whose sizes come from `next_size`, stopping at the first non-Ok
// status as a caller must.
template <class NextSize>
Result run(const SseLimits& limits, std::string_view stream, NextSize next_size) {
  Result r;
  SseParser parser(limits);
  const auto collect = [&](const SseEvent& e) { r.events.push_back(e); };
  while (!stream.empty()) {
    const std::size_t n = std::min(stream.size(), next_size());
    r.status = parser.feed(stream.substr(0, n), collect);
    stream.remove_prefix(n);
    if (r.status != SseParser::Status::Ok) break;
  }
  if (r.status == SseParser::Status::Ok) {
    r.retry_ms = parser.retry_ms();
    r.unterminated = parser.has_unterminated_event();
  }
  return r;
}

// The event stream interpretation of the WHATWG HTML standard, read literally: strip one
// leading BOM, cut the stream into lines at CRLF, LF or CR (the bytes after the last line end
// are an unfinished line and dispatch nothing), and process the fields.
Result reference_events(std::string_view stream) {
  Result r;
  if (stream.starts_with("\xEF\xBB\xBF")) stream.remove_prefix(3);
  std::string data, type, last_id;
  bool data_seen = false;
  while (true) {
    const std::size_t end = stream.find_first_of("\r\n");
    if (end == std::string_view::npos) break;
    const std::string_view line = stream.substr(0, end);
    std::size_t skip = end + 1;
    if (stream[end] == '\r' && end + 1 < stream.size() && stream[end + 1] == '\n') ++skip;
    stream.remove_prefix(skip);

    if (line.empty()) {
      if (data_seen) r.events.push_back({type.empty() ? "message" : type, data, last_id});
      data.clear();
      type.clear();
      data_seen = false;
      continue;
    }
    if (line.front() == ':') continue;
    const std::size_t colon = line.find(':');
    const std::string_view field = line.substr(0, colon);
    std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
    if (value.starts_with(' ')) value.remove_prefix(1);
    if (field == "data") {
      if (data_seen) data += '\n';
      data += value;
      data_seen = true;
    } else if (field == "event") {
      type = value;
    } else if (field == "id") {
      if (value.find('\0') == std::string_view::npos) last_id = value;
    } else if (field == "retry") {
      const bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string_view::npos;
      if (digits && value.size() <= 18) r.retry_ms = std::stoll(std::string(value));
    }
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  batchlm::fuzz::InputReader input(data, size);
  const std::uint8_t limit_choice = input.byte();
  std::uint32_t seed = input.byte() * 2654435761u + 1;
  const std::string_view stream = input.rest();

  SseLimits limits;
  if (limit_choice & 1) {
    limits.max_line_bytes = 1 + (limit_choice >> 1) % 64;
    limits.max_event_bytes = 1 + (limit_choice >> 4) * 8;
  }

  const Result whole = run(limits, stream, [&] { return stream.size(); });
  const Result bytes = run(limits, stream, [] { return std::size_t{1}; });
  const Result chunks = run(limits, stream, [&] {
    seed = seed * 1103515245u + 12345u;
    return std::size_t{1} + (seed >> 16) % 17;
  });
  FUZZ_CHECK(same_events(bytes.events, whole.events) && bytes.status == whole.status &&
                 bytes.retry_ms == whole.retry_ms && bytes.unterminated == whole.unterminated,
             "byte by byte: " + describe(bytes) + "\nin one piece: " + describe(whole));
  FUZZ_CHECK(same_events(chunks.events, whole.events) && chunks.status == whole.status &&
                 chunks.retry_ms == whole.retry_ms && chunks.unterminated == whole.unterminated,
             "in chunks: " + describe(chunks) + "\nin one piece: " + describe(whole));

  for (const SseEvent& e : whole.events) {
    FUZZ_CHECK(e.data.size() <= limits.max_event_bytes, "event larger than the limit");
    FUZZ_CHECK(e.data.find('\r') == std::string::npos && e.type.find_first_of("\r\n") == std::string::npos &&
                   e.last_event_id.find_first_of("\r\n") == std::string::npos,
               "a line end inside a field: " + describe(whole));
  }
  if (whole.status == SseParser::Status::Ok) {
    const Result reference = reference_events(stream);
    FUZZ_CHECK(same_events(reference.events, whole.events) && reference.retry_ms == whole.retry_ms,
               "parser: " + describe(whole) + "\nreference: " + describe(reference));
  }
  return 0;
}
