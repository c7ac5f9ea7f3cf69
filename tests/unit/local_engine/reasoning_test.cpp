// A reasoning model's answer split into its <think> block and the content after it, as the
// embedded engine gives them (Completion::reasoning and text; an API's reasoning_content and
// content), whole and piece by piece.

#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>

#include "batchlm/local_engine/local_backend.hpp"
#include "batchlm/local_engine/tokenizer.hpp"
#include "gguf_writer.hpp"

namespace batchlm::local_engine {
namespace {

struct Split {
  std::string reasoning, content;
  // Each piece's output as it went out, to see that nothing went out early.
  std::vector<ReasoningSplit::Parts> outputs;
};

Split split(const std::vector<std::string>& pieces, bool opened) {
  ReasoningSplit s(opened);
  Split out;
  const auto take = [&](ReasoningSplit::Parts parts) {
    out.reasoning += parts.reasoning;
    out.content += parts.content;
    out.outputs.push_back(std::move(parts));
  };
  for (const std::string& piece : pieces) take(s.add(piece));
  take(s.finish());
  return out;
}

Split whole(const std::string& text, bool opened = false) { return split({text}, opened); }

// One piece per byte: every place a piece can end, a tag's middle included.
Split bytewise(const std::string& text, bool opened = false) {
  std::vector<std::string> pieces;
  for (const char c : text) pieces.emplace_back(1, c);
  return split(pieces, opened);
}

TEST(ReasoningSplit, AnOpeningThinkBlockIsTheReasoningAndWhatFollowsTheContent) {
  for (const auto& s : {whole("<think>\nAdd 2 and 2.\n</think>\n\nIt is 4."),
                        bytewise("<think>\nAdd 2 and 2.\n</think>\n\nIt is 4."),
                        whole("\n  <think>Add 2 and 2.</think>It is 4.")}) {
    EXPECT_EQ(s.reasoning, "Add 2 and 2.");
    EXPECT_EQ(s.content, "It is 4.");
  }
  // Whitespace inside the reasoning and the content stays; only their ends lose it.
  const Split inner = bytewise("<think>\n\nline one\n\nline two \n</think>\n\nA\n\nB\n");
  EXPECT_EQ(inner.reasoning, "line one\n\nline two");
  EXPECT_EQ(inner.content, "A\n\nB\n");
}

TEST(ReasoningSplit, APromptThatOpenedTheBlockMakesTheAnswerBeginInsideIt) {
  // A DeepSeek-R1 distill's generation prompt ends with "<think>\n".
  for (const auto& s : {whole("Add them.\n</think>\n\n4", true), bytewise("Add them.\n</think>\n\n4", true)}) {
    EXPECT_EQ(s.reasoning, "Add them.");
    EXPECT_EQ(s.content, "4");
  }
  // Cut short while reasoning: all of it is reasoning, a tag begun and not finished included.
  EXPECT_EQ(bytewise("Add them and </thi", true).reasoning, "Add them and </thi");
  EXPECT_EQ(bytewise("Add them and </thi", true).content, "");
}

TEST(ReasoningSplit, AnAnswerThatDoesNotOpenWithTheBlockIsAllContentAsWritten) {
  for (const std::string text : {"  Hello <think>x</think> y", "\n\n4", "<thinking>no</thinking>", "<b>bold</b>", "<", ""}) {
    SCOPED_TRACE(text);
    EXPECT_EQ(whole(text).content, text);
    EXPECT_EQ(bytewise(text).content, text);
    EXPECT_EQ(bytewise(text).reasoning, "");
  }
  // Cut short inside the opening tag: the tag's beginning is text.
  EXPECT_EQ(bytewise("<thi").content, "<thi");
}

TEST(ReasoningSplit, EmptyReasoningAndTagLookalikesInsideIt) {
  const Split empty = bytewise("<think>\n\n</think>\n\nHi");  // as Qwen 3 writes it with thinking off
  EXPECT_EQ(empty.reasoning, "");
  EXPECT_EQ(empty.content, "Hi");
  const Split lookalike = bytewise("<think>a </b> and </thin k> c</think>d");
  EXPECT_EQ(lookalike.reasoning, "a </b> and </thin k> c");
  EXPECT_EQ(lookalike.content, "d");
  // A second block after the first is content.
  EXPECT_EQ(whole("<think>a</think>b<think>c</think>").content, "b<think>c</think>");
}

TEST(ReasoningSplit, TextGoesOutAsItComesButForWhatMayStillBeATagOrAnEnd) {
  ReasoningSplit s(false);
  EXPECT_EQ(s.add("<thi").reasoning, "");  // may open the block
  EXPECT_EQ(s.add("nk>\nStep one").reasoning, "Step one");
  EXPECT_EQ(s.add(", two. \n</").reasoning, ", two.");  // whitespace and a tag's beginning held
  const ReasoningSplit::Parts end = s.add("think>\n\nDone");
  EXPECT_EQ(end.reasoning, "");
  EXPECT_EQ(end.content, "Done");
  EXPECT_EQ(s.add(" now.").content, " now.");
  EXPECT_EQ(s.finish().content, "");
}

// Any cut into pieces gives what the whole answer gives.
TEST(ReasoningSplit, PiecesOfAnySizeSplitAsTheWholeAnswer) {
  const std::vector<std::string> words = {"<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "b",
                                          "<thin", "k>", "</thi", "nk>"};
  std::mt19937 rng(5);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string text;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) text += words[rng() % words.size()];
    const bool opened = rng() % 2 == 0;
    std::vector<std::string> pieces;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t len = 1 + rng() % 4;
      pieces.push_back(text.substr(at, len));
      at += len;
    }
    const Split one = whole(text, opened), many = split(pieces, opened);
    ASSERT_EQ(many.reasoning, one.reasoning) << text << " opened " << opened;
    ASSERT_EQ(many.content, one.content) << text << " opened " << opened;
  }
}

// ---- the embedded engine's answers --------------------------------------------------------------

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && std::string_view(" \n\t\r").find(s.front()) != std::string_view::npos) s.remove_prefix(1);
  while (!s.empty() && std::string_view(" \n\t\r").find(s.back()) != std::string_view::npos) s.remove_suffix(1);
  return std::string(s);
}

struct Streamed {
  std::optional<Outcome> outcome;
  std::string reasoning, content;
  std::vector<TokenLogprob> logprobs;
};

// A tiny random model with a DeepSeek-R1 distill's template: its prompt opens the <think> block,
// and the model never closes it, so its whole answer is reasoning.
TEST(LocalBackendReasoning, EveryTokensLogProbabilityGoesOutOnceWhicheverPartItIsIn) {
  const std::string r1 = read_file(std::filesystem::path(BATCHLM_SOURCE_DIR) /
                                   "models/vocab/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja");
  if (r1.empty()) GTEST_SKIP() << "the R1 distill's template is absent (scripts/fetch-vocabs.sh fetches it)";
  std::string dir = (std::filesystem::temp_directory_path() / "batchlm-reasoning-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  batchlm::testing::TinyLlamaOptions o;
  o.chat_template = r1;
  batchlm::testing::write_tiny_llama(std::filesystem::path(dir) / "r1.gguf", o);

  Request request;
  request.messages = {{"user", "What is 2+2?"}};
  request.max_tokens = 24;
  request.temperature = 0;
  request.extra = {{"logprobs", true}};
  std::vector<Streamed> runs;
  for (const bool split : {true, false}) {
    boost::asio::io_context io;
    LocalBackendOptions options;
    options.model = std::filesystem::path(dir) / "r1.gguf";
    options.threads = 1;
    options.split_reasoning = split;
    LocalBackend backend(io.get_executor(), options);
    Streamed& run = runs.emplace_back();
    boost::asio::co_spawn(
        io,
        [&]() -> boost::asio::awaitable<void> {
          run.outcome = co_await backend.complete(request, [&](std::string_view text, std::span<const TokenLogprob> lp, TextPart part) {
            (part == TextPart::kReasoning ? run.reasoning : run.content) += text;
            run.logprobs.insert(run.logprobs.end(), lp.begin(), lp.end());
          });
        },
        boost::asio::detached);
    io.run();
    ASSERT_TRUE(run.outcome && run.outcome->ok()) << run.outcome->error->message;
  }
  std::filesystem::remove_all(dir);
  const Completion &apart = *runs[0].outcome->completion, &kept = *runs[1].outcome->completion;
  ASSERT_TRUE(apart.logprobs && kept.logprobs);
  ASSERT_EQ(apart.logprobs->size(), 24u);
  // The same tokens either way; all of them are reasoning when it is split off.
  ASSERT_EQ(kept.logprobs->size(), apart.logprobs->size());
  for (std::size_t k = 0; k < apart.logprobs->size(); ++k) EXPECT_EQ((*apart.logprobs)[k].token, (*kept.logprobs)[k].token);
  EXPECT_EQ(kept.reasoning, "");
  EXPECT_EQ(apart.text, "");
  ASSERT_NE(trimmed(kept.text), "");
  EXPECT_EQ(apart.reasoning, trimmed(kept.text));
  for (std::size_t i = 0; i < 2; ++i) {
    const Completion& c = *runs[i].outcome->completion;
    EXPECT_EQ(runs[i].reasoning, c.reasoning);
    EXPECT_EQ(runs[i].content, c.text);
    // Each token's log-probability went out once, in order.
    ASSERT_EQ(runs[i].logprobs.size(), c.logprobs->size());
    for (std::size_t k = 0; k < c.logprobs->size(); ++k) {
      EXPECT_EQ(runs[i].logprobs[k].token, (*c.logprobs)[k].token);
      EXPECT_EQ(runs[i].logprobs[k].logprob, (*c.logprobs)[k].logprob);
    }
  }
}

}  // namespace
}  // namespace batchlm::local_engine
