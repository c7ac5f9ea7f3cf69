// Chat templates (local_engine/tokenizer/chat_template.cpp): ChatTemplate::from_vocab on an
// arbitrary tokenizer.chat_template text from a GGUF file, then apply() to arbitrary messages.
//
// Input: a flags byte (bit 0: add_generation_prompt), the template up to the first NUL byte,
// then NUL-separated role and content strings, alternating.
//
// Promised: a template is recognised or refused with std::invalid_argument ("chat template:
// ..."), never a crash or a hang. Checked: a recognised template's default system message is
// valid UTF-8 when the template is, and holds no end-of-turn marker; apply() renders exactly
// the ChatML turns — the default system turn when the first message is not a system message,
// then one turn per message, then the generation prompt when asked.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/local_engine/tokenizer.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::local_engine;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const bool add_generation_prompt = input.byte() & 1;
  Vocab vocab;
  vocab.chat_template = std::string(input.until('\0'));
  std::vector<ChatMessage> messages;
  while (!input.empty()) {
    ChatMessage m;
    m.role = std::string(input.until('\0'));
    m.content = std::string(input.until('\0'));
    messages.push_back(std::move(m));
  }

  ChatTemplate chat;
  try {
    chat = ChatTemplate::from_vocab(vocab);
  } catch (const std::invalid_argument& e) {
    FUZZ_CHECK(std::string(e.what()).starts_with("chat template: "), std::string("unexpected error: ") + e.what());
    return 0;
  }
  FUZZ_CHECK(chat.name() == "chatml", "template family " + std::string(chat.name()));
  const std::string& system = chat.default_system();
  if (fuzz::valid_utf8(vocab.chat_template))
    FUZZ_CHECK(fuzz::valid_utf8(system), "an invalid UTF-8 default system message from a valid template");
  FUZZ_CHECK(system.find("<|im_end|>") == std::string::npos, "the default system message ends a turn");

  std::string expected;
  const auto turn = [&](const std::string& role, const std::string& content) {
    expected += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
  };
  if (!system.empty() && !messages.empty() && messages.front().role != "system") turn("system", system);
  for (const ChatMessage& m : messages) turn(m.role, m.content);
  if (add_generation_prompt) expected += "<|im_start|>assistant\n";
  const std::string rendered = chat.apply(messages, add_generation_prompt);
  FUZZ_CHECK(rendered == expected, "rendered:\n" + rendered + "\nexpected:\n" + expected);
  return 0;
}
