#pragma once
// The tokenizers of GGUF vocabularies, as llama.cpp runs them: byte-level BPE
// (tokenizer.ggml.model = "gpt2") with the model family's pre-tokenizer (tokenizer.ggml.pre), and
// SentencePiece's BPE with byte fallback (tokenizer.ggml.model = "llama": Llama 2, Mistral 7B,
// Phi-3, ...). Both with special and control tokens, and a streaming decoder that never splits a
// UTF-8 character. Also the family's chat template.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "batchlm/core/types.hpp"
#include "batchlm/local_engine/gguf.hpp"

namespace batchlm::local_engine {

using Token = std::int32_t;

// tokenizer.ggml.token_type values.
enum class TokenType : std::int32_t {
  Undefined = 0, Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6,
};

// What the GGUF says about the vocabulary; Tokenizer validates it.
struct Vocab {
  std::string model = "gpt2";            // tokenizer.ggml.model: "gpt2" or "llama"
  std::string pre = "default";           // tokenizer.ggml.pre ("gpt2" only)
  // Token text: byte-level encoded for "gpt2" ("Ġworld"); for "llama" UTF-8 with U+2581 for
  // a space ("▁world"), and "<0x0A>" for the byte tokens.
  std::vector<std::string> tokens;
  // Same length as tokens (Normal when absent). A "llama" Tokenizer's vocab() has the texts that
  // llama.cpp always takes for control tokens ("</s>", "<|end|>", ...) as Control.
  std::vector<TokenType> types;
  std::vector<std::string> merges;       // "a b", by rank ("gpt2" only)
  std::vector<float> scores;             // tokenizer.ggml.scores, one per token ("llama" only)
  // From the file; where a key is absent, "llama" vocabularies take llama.cpp's defaults:
  // bos 1, eos 2, unk 0, add_bos and add_space_prefix true.
  Token bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, pad = -1;
  bool add_bos = false;
  // tokenizer.ggml.add_space_prefix ("llama" only): a "▁" goes in front of the text, and of the
  // text after each special token.
  bool add_space_prefix = false;
  // Phi-3, which llama.cpp recognises by general.name ("phi-3" or "phi3" in it): the whitespace
  // after a special token, other than <unk>, <s> and <|endoftext|>, is dropped before tokenizing.
  bool strip_after_special = false;
  std::string chat_template;             // tokenizer.chat_template, may be empty

  // Reads the tokenizer.* keys. Throws gguf::Error naming the file and key.
  static Vocab from_gguf(const gguf::File& file);
};

class Tokenizer {
 public:
  // Throws std::invalid_argument for an unsupported model or pre-tokenizer, a merge that
  // names a token not in the vocabulary, or ("llama") scores that do not match the tokens.
  explicit Tokenizer(Vocab vocab);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;

  // Text to tokens. With parse_special, the text of control tokens ("<|im_start|>") becomes
  // that token; without, it is tokenized as plain text. User-defined tokens are matched either
  // way. No BOS is added here; add_bos() tells the caller whether the model wants one.
  std::vector<Token> encode(std::string_view text, bool parse_special) const;

  // The bytes a token stands for (llama.cpp's llama_token_to_piece): "▁" of "llama" tokens
  // as a space, a byte token as its byte. Control tokens give "" unless render_special.
  std::string token_bytes(Token t, bool render_special = false) const;
  // The same as token_bytes(t), viewed in the tokenizer rather than copied.
  std::string_view token_view(Token t) const;
  // The tokens' bytes joined, nothing cleaned up. For "gpt2", decode(encode(x)) == x. (For most
  // pre-tokenizers, though not smollm, qwen2, tekken or gpt-4o, llama.cpp's llama_detokenize
  // also drops the space before "?", "!", ".", "," and some contractions, its clean_spaces; the
  // pieces of single tokens, which llama-server streams, are never cleaned.) For "llama" with
  // add_space_prefix, decode(encode(x)) == " " + x for a non-empty valid UTF-8 x without
  // special-token text or U+2581 (which comes back as a space), given the byte tokens: the
  // prefix comes back as a space. llama_detokenize drops one leading space of the first token's
  // piece (unless a BOS comes first); llama-server's stream does not.
  std::string decode(std::span<const Token> tokens, bool render_special = false) const;

  std::size_t size() const;
  const Vocab& vocab() const;
  bool add_bos() const;
  // End of generation: eos, eot (<|im_end|> for ChatML models), eom.
  bool is_end_of_generation(Token t) const;
  // All of them, by id.
  std::vector<Token> end_of_generation_tokens() const;
  // The id of a token given by its exact text, or -1.
  Token find(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Turns a token stream into text; holds back the bytes of an incomplete UTF-8 character until
// the token that completes it arrives.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool render_special = false);
  std::string push(Token t);   // the newly completed text, possibly empty
  std::string finish();        // whatever is left, invalid bytes replaced by U+FFFD

 private:
  const Tokenizer* tokenizer_;
  bool render_special_;
  std::string pending_;
};

// The chat template of the model family, recognised from the GGUF template text rather than run
// as Jinja. Seven families:
//   ChatML   <|im_start|>role\ncontent<|im_end|>\n per message (SmolLM2, Qwen2.5, Qwen3), with
//            the default system message a template inserts when the conversation has none.
//            Qwen3's template (recognised by its reasoning_content and </think> handling) also
//            drops the <think>...</think> reasoning of assistant turns before the last user turn
//            and writes the turns after it with their reasoning in a <think> block.
//   Llama 3  <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> per message, contents
//            trimmed (Llama 3, 3.1, 3.2, 3.3). From 3.1 on the template always opens with a system
//            turn "Cutting Knowledge Date: December 2023\nToday Date: DATE\n\n" + the system
//            message (or nothing): DATE is today's (as "26 Nov 2026") where the template asks for
//            strftime_now, else the date the template sets. The BOS token the template begins
//            with is the tokenizer's to add (Tokenizer::add_bos), not part of the text.
//            Tools (3.1, 3.2, 3.3): "Environment: ipython\n" heads the system turn, and the
//            tools, each as tojson(indent=4) writes it, go into the first user turn after the
//            template's instructions; an assistant's call is written as its only content,
//            {"name": "NAME", "parameters": ARGUMENTS} (a message with several calls, which
//            the template refuses, as that many turns); a tool's result is an "ipython" turn
//            holding its content as a JSON string.
//   DeepSeek-R1 (its Qwen2.5 and Llama 3 distills): the last system message's content, bare,
//            then <｜User｜>content per user message and <｜Assistant｜>content<｜end▁of▁sentence｜>
//            per assistant message, its reasoning up to the last </think> dropped; the
//            generation prompt is <｜Assistant｜>, with "<think>\n" after it where the template
//            writes that (the distills' later templates). BOS as for Llama 3.
//   Phi-3    <|role|>\ncontent<|end|>\n per user and assistant message, and per system message
//            where the template has system turns (Phi-3.5's only those with content; Phi-3's
//            first templates leave system messages out, and write the assistant's tag after
//            each user turn, which is the same text for alternating turns ending in the
//            generation prompt); the generation prompt is <|assistant|>\n. Without the
//            generation prompt Phi-3.5's template ends with the EOS token's text, which is left
//            out here as the BOS token is.
//   Mistral  [INST] user [/INST] answer</s> per turn, with the spaces the template's constants
//            have (v0.1/v0.2: " [INST] ... [/INST] answer</s>"; v0.3: "[INST] ...[/INST] answer</s>"
//            with the answer trimmed; Nemo: "[INST]...[/INST]answer</s>"); the system message
//            joins the first user turn (v0.2) or the last message when that is a user turn
//            (v0.3), "system\n\nuser", and a template without either takes none. As these
//            templates do, messages other than an optional first system message must alternate
//            user/assistant from a user message, else std::invalid_argument. The prompt ends
//            with [/INST].
//   Llama 2  [INST] content [/INST] per user turn, contents stripped, the first with the system
//            message as "<<SYS>>\nsystem\n<</SYS>>\n\n" at its head, and " answer </s>" per
//            answer; every user turn after the first opens with the BOS token's text (the
//            first BOS is the tokenizer's). Roles alternate as for Mistral.
//   Gemma    <start_of_turn>user\ncontent<end_of_turn>\n per user message and the same with
//            "model" per assistant message, contents trimmed (Gemma 2, Gemma 3); the generation
//            prompt is <start_of_turn>model\n. Gemma 3's template puts a first system message, as
//            it is, at the head of the first user turn, followed by the separator its
//            first_user_prefix writes ("\n\n"). Gemma 2's template refuses a system message; here
//            it goes there trimmed, with "\n\n" after it unless empty, as llama.cpp's own Gemma
//            formatting does. Roles alternate as for Mistral. BOS as for Llama 3.
enum class CallFormat { kNone, kTagged, kJson };

// The chat template families ChatTemplate::from_vocab recognises, for messages.
inline constexpr const char* kSupportedChatTemplates = "ChatML, Llama 3, DeepSeek-R1, Phi-3, Mistral, Llama 2 and Gemma";

class ChatTemplate {
 public:
  // Throws std::invalid_argument when the template is not one this build supports.
  static ChatTemplate from_vocab(const Vocab& vocab);
  // `tools`: the request's function tools (null or an empty array for none), rendered where
  // the template lists them (calls_tools()); a template that does not throws for them.
  std::string apply(std::span<const ChatMessage> messages, bool add_generation_prompt,
                    const nlohmann::ordered_json& tools = nullptr) const;
  // "chatml", "llama3", "deepseek-r1", "phi3", "mistral", "llama2" or "gemma"
  std::string_view name() const { return name_; }
  const std::string& default_system() const { return default_system_; }
  // Llama 3.1 and later: the date the system turn gives ("26 Jul 2024"), or "today".
  const std::string& date() const { return date_; }
  // Qwen3's: assistant turns' <think> reasoning is kept only after the last user turn.
  bool reasoning_turns() const { return reasoning_; }
  // DeepSeek-R1's: the generation prompt opens a <think> block.
  bool opens_reasoning() const { return opens_reasoning_; }
  // Qwen 3's enable_thinking: what the template writes after the generation prompt when it is
  // false (an empty <think> block, "<think>\n\n</think>\n\n"); empty for a template without the
  // switch, which a Jinja template would leave unread.
  std::string_view thinking_off() const { return thinking_off_; }
  // Phi-3's: whether system messages are turns (else they are left out).
  bool system_turns() const { return system_turns_; }
  // Whether the template lists tools and shows the model its calls and their results, and in
  // which form the model calls them (parse_tool_calls reads that form):
  //   kTagged  Qwen 2.5's and Qwen 3's: the tools in the system turn, a call as
  //            <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, results in a user
  //            turn as <tool_response>...</tool_response>.
  //   kJson    Llama 3.1's, 3.2's and 3.3's: the tools in the first user turn, and an answer
  //            that is a call is the call alone, {"name": ..., "parameters": ...} (calls one
  //            after another separated by ';').
  bool calls_tools() const { return call_format_ != CallFormat::kNone; }
  CallFormat call_format() const { return call_format_; }

 private:
  std::string name_ = "chatml";
  std::string default_system_;
  std::string date_;  // empty: no dated system turn
  bool reasoning_ = false;
  bool opens_reasoning_ = false;
  std::string thinking_off_;
  bool system_turns_ = false;
  bool skip_empty_system_ = false;
  bool phi_newlines_ = true;  // Phi-3's "<|user|>\n"; Phi-4-mini's tags take none
  // Mistral's.
  std::string inst_open_, inst_close_, eos_text_, bos_text_;
  bool answer_space_ = false, answer_trim_ = false;
  // Which user turn Mistral's system message joins (kNone: the template takes none).
  enum class SystemTurn { kNone, kFirst, kLast };
  SystemTurn system_turn_ = SystemTurn::kNone;
  // Gemma 3's: what its first_user_prefix writes after the system message; none for Gemma 2's,
  // whose template takes no system message.
  std::optional<std::string> system_separator_;
  std::string apply_with_tool_turns(std::span<const ChatMessage> messages, bool add_generation_prompt,
                                    const nlohmann::ordered_json& tools) const;
  // ChatML tool calling (calls_tools()): what the template writes before the tools and after
  // them, and whether a call's tag follows a newline it writes itself (Qwen 2.5) or one written
  // only between parts (Qwen 3).
  std::string tools_preamble_, tools_postamble_;
  bool newline_before_call_ = false;
  CallFormat call_format_ = CallFormat::kNone;
  // Llama 3.1's and later's (kJson): the instructions the first user turn opens with before the
  // tools.
  std::string user_tools_preamble_;
};

// What opens the answer after the template's generation prompt for a request with these extra
// fields: the empty <think> block of enable_thinking false (ChatTemplate::thinking_off()), then a
// forced call's opening (forced_call_opening) when tools are shown and tool_choice forces one.
std::string answer_prefix(const ChatTemplate& chat_template, const nlohmann::ordered_json& extra);

// An answer that tool_choice forces to be a call, in the template's form: what opens it after
// the generation prompt ("<tool_call>\n" for kTagged; nothing for kJson, whose call is the whole
// answer), and the key the call gives its arguments under ("arguments", or "parameters").
std::string_view forced_call_opening(CallFormat format);
std::string_view call_arguments_key(CallFormat format);

// Why a model with this template cannot take tools, or a conversation's calls and results
// (it does not list tools); nullopt when it can.
std::optional<std::string> tools_problem(const ChatTemplate& chat_template);

// Where calls may begin in an answer: after the reasoning, when it opens with a
// <think>...</think> block (as Qwen 3 writes it), else at 0; nullopt while it is still
// reasoning (no </think> yet). A <tool_call> the model writes while it reasons is text.
std::optional<std::size_t> answer_start(std::string_view text);

// An answer split, as it streams, into the reasoning a model writes in a <think> ... </think>
// block at its start and the content after the block (an API's `reasoning_content` and
// `content`). `opened`: the prompt opened the block (a DeepSeek-R1 distill's generation prompt
// ends with "<think>\n"), so the answer begins inside it. The reasoning is given without the
// whitespace at its ends, the content without the whitespace at its start. An answer that
// does not open with a block is all content; one that ends inside the block (cut short) is all
// reasoning. The text of each piece goes out at once but for what may still turn out to be
// part of a tag or the whitespace at an end.
class ReasoningSplit {
 public:
  explicit ReasoningSplit(bool opened) : state_(opened ? State::kReasoningStart : State::kStart) {}
  struct Parts {
    std::string reasoning, content;
  };
  // The next piece of the answer; returns what of it goes out now.
  Parts add(std::string_view piece);
  // The answer is whole: what was held back.
  Parts finish();

 private:
  enum class State { kStart, kReasoningStart, kReasoning, kContentStart, kContent };
  State state_;
  std::string held_;  // text not yet given out
};

// An answer's tool calls, in the form the template teaches (ChatTemplate::call_format()).
// kTagged: every <tool_call>{"name": ..., "arguments": {...}}</tool_call> block of `text` after
// its reasoning. kJson: the answer after its reasoning, when it is nothing but calls
// {"name": ..., "parameters": {...}} ("arguments" read as well), separated by ';'. Either as
// [{id, type: "function", function: {name, arguments}}] with the arguments as JSON text (their
// keys in the order written), ids "call_" and 24 random letters and digits; `content` is the text
// outside the blocks, the reasoning included, trimmed. nullopt when the text holds no block, or
// a block that is not one whole call (unclosed, not JSON, no name): the text is then the answer
// as it stands.
struct ParsedToolCalls {
  std::string content;
  nlohmann::json calls;
  std::string outside;  // the text outside the blocks as written (content before trimming)
};
std::optional<ParsedToolCalls> parse_tool_calls(std::string_view text, CallFormat format = CallFormat::kTagged);
// The first byte of `text` from which it might begin a call (a "<tool_call>" or a prefix of one
// at its end): what a stream may send as text before the answer is whole.
std::size_t tool_call_start(std::string_view text);

// An answer that may hold tool calls, streamed: the text goes out up to where a call may begin;
// once a call has begun (a <tool_call>, or for kJson an answer that opens with '{'), the rest is
// held until the answer is whole, when it is either calls (finish()) or text after all (rest()).
class ToolCallStream {
 public:
  explicit ToolCallStream(CallFormat format = CallFormat::kTagged) : format_(format) {}
  // Adds the next piece of the answer; returns what may go out now (often all of it).
  std::string add(std::string_view piece);
  // The calls and the text beside them, when the answer holds whole calls (parse_tool_calls).
  std::optional<ParsedToolCalls> finish() const { return parse_tool_calls(text_, format_); }
  // What has not gone out, for an answer that holds no calls after all.
  std::string_view rest() const { return std::string_view(text_).substr(sent_); }
  // For an answer that holds calls: the text beside them that has not gone out (the text after
  // and between the calls, less trailing whitespace).
  std::string unsent_content(const ParsedToolCalls& parsed) const;
  const std::string& text() const { return text_; }

 private:
  std::optional<std::size_t> answer_from();

  CallFormat format_;
  std::string text_;
  std::size_t sent_ = 0;
  std::optional<std::size_t> answer_;  // answer_start(text_), once it can no longer change
  std::size_t searched_ = 0;           // how far </think> has been looked for
  bool holding_ = false;
  bool plain_ = false;  // kJson: the answer opened with text, so it holds no calls
};

}  // namespace batchlm::local_engine
