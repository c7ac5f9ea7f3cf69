#include "batchlm/client/sse.hpp"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace batchlm::client {
namespace {

struct Parsed {
  std::vector<SseEvent> events;
  SseParser::Status status = SseParser::Status::Ok;
  bool unterminated = false;
  std::optional<long long> retry_ms;
};

Parsed parse_in_pieces(std::string_view stream, const std::vector<std::size_t>& cuts,
                       SseLimits limits = {}) {
  SseParser parser(limits);
  Parsed parsed;
  std::size_t from = 0;
  auto feed = [&](std::size_t to) {
    if (parsed.status != SseParser::Status::Ok) return;
    parsed.status = parser.feed(stream.substr(from, to - from),
                                [&](const SseEvent& e) { parsed.events.push_back(e); });
    from = to;
  };
  for (std::size_t cut : cuts) feed(cut);
  feed(stream.size());
  parsed.unterminated = parser.has_unterminated_event();
  parsed.retry_ms = parser.retry_ms();
  return parsed;
}

void expect_same(const Parsed& a, const Parsed& b, const std::string& how) {
  ASSERT_EQ(a.status, b.status) << how;
  ASSERT_EQ(a.events.size(), b.events.size()) << how;
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    EXPECT_EQ(a.events[i].type, b.events[i].type) << how << " event " << i;
    EXPECT_EQ(a.events[i].data, b.events[i].data) << how << " event " << i;
    EXPECT_EQ(a.events[i].last_event_id, b.events[i].last_event_id) << how << " event " << i;
  }
  // After a cap is hit the parser stops where it is; what it had buffered says nothing.
  if (a.status == SseParser::Status::Ok) {
    EXPECT_EQ(a.unterminated, b.unterminated) << how;
  }
  EXPECT_EQ(a.retry_ms, b.retry_ms) << how;
}

// Parses the stream whole, then one byte at a time, then split in two at every position,
// and checks that every way of cutting it gives the same result.
Parsed parse(std::string_view stream, SseLimits limits = {}) {
  Parsed whole = parse_in_pieces(stream, {}, limits);
  std::vector<std::size_t> every_byte;
  for (std::size_t i = 1; i < stream.size(); ++i) every_byte.push_back(i);
  expect_same(whole, parse_in_pieces(stream, every_byte, limits), "one byte at a time");
  for (std::size_t cut = 0; cut <= stream.size(); ++cut)
    expect_same(whole, parse_in_pieces(stream, {cut}, limits), "split at " + std::to_string(cut));
  return whole;
}

std::vector<std::string> data_of(const Parsed& parsed) {
  std::vector<std::string> out;
  for (const auto& e : parsed.events) out.push_back(e.data);
  return out;
}

using Strings = std::vector<std::string>;

TEST(SseParser, DispatchesOnBlankLine) {
  auto p = parse("data: hello\n\n");
  EXPECT_EQ(data_of(p), Strings{"hello"});
  EXPECT_EQ(p.events[0].type, "message");
  EXPECT_FALSE(p.unterminated);
}

TEST(SseParser, AcceptsLfCrlfAndLoneCrLineEnds) {
  EXPECT_EQ(data_of(parse("data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d\r\n\n")),
            (Strings{"a", "b", "c", "d"}));
}

TEST(SseParser, CrAtEndOfChunkAndLfAtStartOfNextAreOneLineEnd) {
  SseParser parser;
  std::vector<std::string> seen;
  auto collect = [&](const SseEvent& e) { seen.push_back(e.data); };
  ASSERT_EQ(parser.feed("data: a\r", collect), SseParser::Status::Ok);
  ASSERT_EQ(parser.feed("\ndata: b\r", collect), SseParser::Status::Ok);
  EXPECT_TRUE(seen.empty());  // "\r\n" then "data: b\r": no blank line yet
  ASSERT_EQ(parser.feed("\n\r\n", collect), SseParser::Status::Ok);
  EXPECT_EQ(seen, Strings{"a\nb"});
}

TEST(SseParser, CrFollowedByLfInLaterEmptyFeedStillCountsOnce) {
  SseParser parser;
  std::vector<std::string> seen;
  auto collect = [&](const SseEvent& e) { seen.push_back(e.data); };
  parser.feed("data: a\r", collect);
  parser.feed("", collect);
  parser.feed("\n", collect);
  EXPECT_TRUE(seen.empty());
  parser.feed("\n", collect);
  EXPECT_EQ(seen, Strings{"a"});
}

TEST(SseParser, JoinsMultiLineDataWithNewline) {
  EXPECT_EQ(data_of(parse("data: one\ndata: two\ndata:three\n\n")), Strings{"one\ntwo\nthree"});
}

TEST(SseParser, RemovesOnlyOneLeadingSpaceAfterColon) {
  EXPECT_EQ(data_of(parse("data:  two spaces\n\ndata:none\n\n")),
            (Strings{" two spaces", "none"}));
}

TEST(SseParser, FieldWithoutColonHasEmptyValue) {
  EXPECT_EQ(data_of(parse("data\ndata\n\n")), Strings{"\n"});
}

TEST(SseParser, EmptyDataFieldDispatchesEmptyEvent) {
  auto p = parse("data:\n\n");
  ASSERT_EQ(p.events.size(), 1u);
  EXPECT_EQ(p.events[0].data, "");
}

TEST(SseParser, SkipsLeadingByteOrderMark) {
  EXPECT_EQ(data_of(parse("\xEF\xBB\xBF" "data: x\n\n")), Strings{"x"});
}

TEST(SseParser, ByteOrderMarkOnlySkippedAtVeryStart) {
  // A second BOM, or one later in the stream, is part of the field name: the line is ignored.
  EXPECT_TRUE(parse("\xEF\xBB\xBF\xEF\xBB\xBF" "data: x\n\n").events.empty());
  EXPECT_EQ(data_of(parse("data: a\n\n\xEF\xBB\xBF" "data: b\n\ndata: c\n\n")),
            (Strings{"a", "c"}));
  EXPECT_EQ(data_of(parse("data: \xEF\xBB\xBF\n\n")), Strings{"\xEF\xBB\xBF"});
}

TEST(SseParser, PartialByteOrderMarkIsContent) {
  // "\xEF\xBB" then "data" makes the field name "\xEF\xBBdata": not a data field.
  EXPECT_TRUE(parse("\xEF\xBB" "data: x\n\n").events.empty());
}

TEST(SseParser, IgnoresCommentLines) {
  auto p = parse(": keep-alive\n:\ndata: x\n: inside\n\n: trailing comment\n");
  EXPECT_EQ(data_of(p), Strings{"x"});
  EXPECT_FALSE(p.unterminated);
}

TEST(SseParser, EventFieldSetsTypeForOneEvent) {
  auto p = parse("event: error\ndata: boom\n\ndata: next\n\n");
  ASSERT_EQ(p.events.size(), 2u);
  EXPECT_EQ(p.events[0].type, "error");
  EXPECT_EQ(p.events[1].type, "message");
}

TEST(SseParser, EmptyDataBufferIsNotDispatched) {
  auto p = parse("event: ping\n\nid: 5\n\n\n\ndata: x\n\n");
  ASSERT_EQ(p.events.size(), 1u);
  EXPECT_EQ(p.events[0].type, "message");  // the type of the undispatched event is dropped
  EXPECT_EQ(p.events[0].last_event_id, "5");
}

TEST(SseParser, IdPersistsAcrossEvents) {
  auto p = parse("id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\n");
  ASSERT_EQ(p.events.size(), 3u);
  EXPECT_EQ(p.events[0].last_event_id, "1");
  EXPECT_EQ(p.events[1].last_event_id, "1");
  EXPECT_EQ(p.events[2].last_event_id, "");
}

TEST(SseParser, IdContainingNulIsIgnored) {
  using namespace std::string_literals;
  const std::string stream = "id: 7\ndata: a\n\nid: 8\0x\ndata: b\n\n"s;
  auto p = parse(stream);
  ASSERT_EQ(p.events.size(), 2u);
  EXPECT_EQ(p.events[1].last_event_id, "7");
}

TEST(SseParser, RetryAcceptsAsciiDigitsOnly) {
  EXPECT_EQ(parse("retry: 2500\n\n").retry_ms, 2500);
  EXPECT_EQ(parse("retry: 100\nretry: 2x\nretry: -5\nretry: 1.5\nretry:\nretry:  7\n\n").retry_ms, 100);
}

TEST(SseParser, UnknownFieldsAreIgnored) {
  EXPECT_EQ(data_of(parse("foo: bar\ndata: x\nDATA: y\n\n")), Strings{"x"});
}

TEST(SseParser, UnterminatedFinalEventIsNeverDispatched) {
  auto p = parse("data: a\n\ndata: b\n");
  EXPECT_EQ(data_of(p), Strings{"a"});
  EXPECT_TRUE(p.unterminated);
  auto partial_line = parse("data: a\n\ndata: b");
  EXPECT_EQ(data_of(partial_line), Strings{"a"});
  EXPECT_TRUE(partial_line.unterminated);
}

TEST(SseParser, CapsLineLength) {
  SseLimits limits;
  limits.max_line_bytes = 8;
  EXPECT_EQ(parse("data: 12\n\n", limits).status, SseParser::Status::Ok);  // exactly 8
  EXPECT_EQ(parse("data: 123\n\n", limits).status, SseParser::Status::LineTooLong);
  EXPECT_EQ(parse("data: 1234567", limits).status, SseParser::Status::LineTooLong);
}

TEST(SseParser, CapsEventSize) {
  SseLimits limits;
  limits.max_event_bytes = 5;
  EXPECT_EQ(data_of(parse("data: ab\ndata: cd\n\n", limits)), Strings{"ab\ncd"});
  auto p = parse("data: ab\ndata: cde\n\n", limits);
  EXPECT_EQ(p.status, SseParser::Status::EventTooLarge);
  EXPECT_TRUE(p.events.empty());
}

TEST(SseParser, ParsesAChatCompletionStream) {
  const std::string stream =
      "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r\n\r\n"
      ": ping\r\n"
      "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\r\n\r\n"
      "data: [DONE]\r\n\r\n";
  EXPECT_EQ(data_of(parse(stream)),
            (Strings{"{\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}",
                     "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}", "[DONE]"}));
}

}  // namespace
}  // namespace batchlm::client
