#include "batchlm/client/sse.hpp"

#include <algorithm>

namespace batchlm::client {

namespace {

constexpr std::string_view kBom = "\xEF\xBB\xBF";

// More digits than this cannot fit a long long; such a `retry` value is ignored, like any
// other value the parser cannot represent.
constexpr std::size_t kMaxRetryDigits = 18;

}  // namespace

SseParser::SseParser(SseLimits limits) : limits_(limits) {}

bool SseParser::has_unterminated_event() const {
  if (fields_seen_) return true;
  // A partial line counts unless it is a comment, which can never start an event.
  return !line_.empty() && line_.front() != ':';
}

SseParser::Status SseParser::feed(std::string_view bytes,
                                  const std::function<void(const SseEvent&)>& on_event) {
  if (!bom_checked_) {
    // The BOM may itself arrive split across feeds: its bytes wait in line_ until all three
    // are seen or one differs (then they are ordinary content of the first line).
    while (!bytes.empty() && line_.size() < kBom.size() && bytes.front() == kBom[line_.size()]) {
      line_.push_back(bytes.front());
      bytes.remove_prefix(1);
    }
    if (line_.size() == kBom.size()) {
      line_.clear();
      bom_checked_ = true;
    } else if (bytes.empty()) {
      return Status::Ok;
    } else {
      bom_checked_ = true;
    }
  }

  if (pending_cr_ && !bytes.empty()) {
    pending_cr_ = false;
    if (bytes.front() == '\n') bytes.remove_prefix(1);
  }

  while (!bytes.empty()) {
    const std::size_t end = bytes.find_first_of("\r\n");
    if (end == std::string_view::npos) {
      if (line_.size() + bytes.size() > limits_.max_line_bytes) return Status::LineTooLong;
      line_.append(bytes);
      return Status::Ok;
    }
    if (line_.size() + end > limits_.max_line_bytes) return Status::LineTooLong;

    // Whole lines inside one chunk are parsed in place; only a line split across feeds is
    // copied.
    std::string_view line;
    if (line_.empty()) {
      line = bytes.substr(0, end);
    } else {
      line_.append(bytes.substr(0, end));
      line = line_;
    }
    const bool ended_by_cr = bytes[end] == '\r';
    bytes.remove_prefix(end + 1);
    if (ended_by_cr) {
      if (bytes.empty()) {
        pending_cr_ = true;
      } else if (bytes.front() == '\n') {
        bytes.remove_prefix(1);
      }
    }

    const Status status = process_line(line, on_event);
    line_.clear();
    if (status != Status::Ok) return status;
  }
  return Status::Ok;
}

SseParser::Status SseParser::process_line(
    std::string_view line, const std::function<void(const SseEvent&)>& on_event) {
  if (line.empty()) {
    const bool dispatch = data_seen_;
    fields_seen_ = false;
    data_seen_ = false;
    if (dispatch) {
      SseEvent event;
      event.type = event_type_.empty() ? "message" : std::move(event_type_);
      event.data = std::move(data_);
      event.last_event_id = last_id_;
      data_.clear();
      event_type_.clear();
      on_event(event);
    } else {
      data_.clear();
      event_type_.clear();
    }
    return Status::Ok;
  }
  if (line.front() == ':') return Status::Ok;

  std::string_view field = line;
  std::string_view value;
  if (const std::size_t colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  }
  fields_seen_ = true;

  if (field == "data") {
    const std::size_t added = value.size() + (data_seen_ ? 1 : 0);
    if (data_.size() + added > limits_.max_event_bytes) return Status::EventTooLarge;
    if (data_seen_) data_.push_back('\n');
    data_.append(value);
    data_seen_ = true;
  } else if (field == "event") {
    event_type_.assign(value);
  } else if (field == "id") {
    if (value.find('\0') == std::string_view::npos) last_id_.assign(value);
  } else if (field == "retry") {
    const bool digits_only =
        !value.empty() && std::all_of(value.begin(), value.end(),
                                      [](char c) { return c >= '0' && c <= '9'; });
    if (digits_only && value.size() <= kMaxRetryDigits) {
      long long ms = 0;
      for (char c : value) ms = ms * 10 + (c - '0');
      retry_ms_ = ms;
    }
  }
  // Any other field name is ignored, as the standard requires.
  return Status::Ok;
}

}  // namespace batchlm::client
