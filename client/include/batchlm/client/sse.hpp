#pragma once
// Server-sent events, parsed by the WHATWG rules: CRLF, LF or lone CR line ends (a CR at the
// end of one chunk followed by LF at the start of the next is one line end), a leading BOM
// skipped, comment lines (":") ignored, multi-line `data` joined with "\n", `event`, `id`
// (ignored when it contains NUL) and `retry` (digits only) fields, a blank line dispatches,
// an event with an empty data buffer is not dispatched, and an unterminated final event is
// never dispatched.

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace batchlm::client {

struct SseEvent {
  std::string type = "message";  // the `event` field, "message" when absent
  std::string data;              // `data` lines joined with "\n"
  std::string last_event_id;     // the last `id` seen on the stream so far
};

struct SseLimits {
  std::size_t max_line_bytes = 1 << 20;   // one line, without its line end
  std::size_t max_event_bytes = 8 << 20;  // the data of one event
};

class SseParser {
 public:
  enum class Status { Ok, LineTooLong, EventTooLarge };

  explicit SseParser(SseLimits limits = {});

  // Feeds the next bytes of the stream (any split, down to one byte). Calls on_event for each
  // complete event. After a non-Ok status the parser must not be fed again.
  Status feed(std::string_view bytes, const std::function<void(const SseEvent&)>& on_event);

  // The reconnection time last set by a `retry` field, if any.
  std::optional<long long> retry_ms() const { return retry_ms_; }

  // True when bytes of an event that was never terminated by a blank line are buffered.
  bool has_unterminated_event() const;

 private:
  Status process_line(std::string_view line,
                      const std::function<void(const SseEvent&)>& on_event);

  SseLimits limits_;
  std::string line_;         // the current, not yet terminated line
  std::string data_;         // data buffer of the event being built
  std::string event_type_;   // event type buffer
  std::string last_id_;      // last event id
  bool data_seen_ = false;   // at least one data field in this event
  bool fields_seen_ = false; // any field in this event (for has_unterminated_event)
  bool bom_checked_ = false;
  bool pending_cr_ = false;  // the previous chunk ended in CR: a leading LF belongs to it
  std::optional<long long> retry_ms_;
};

}  // namespace batchlm::client
