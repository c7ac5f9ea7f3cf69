#!/usr/bin/env bash
# Writes seed inputs for every harness, made from real inputs, into OUT_DIR/<harness>/:
#   gguf, chat_template  small valid GGUF files and templates (make_fuzz_seeds), the start of
#                        the default model
#   sse, openai_answer   SSE streams and JSON answers captured from the fake OpenAI server
#                        (every stream fault it can inject), and error responses
#   job                  jobs/*.yaml, with and without overrides
#   source               GSM8K lines and OpenAI Batch-API lines
#   server_request       chat and completion request bodies
#   tokenizer            GSM8K questions, a ChatML prompt, text in several scripts
#
#   tests/fuzz/make_seeds.sh BUILD_DIR OUT_DIR
#
# BUILD_DIR is a BATCHLM_FUZZ build (make_fuzz_seeds) that also has bin/fake_openai_server.
set -euo pipefail
build=${1:?usage: make_seeds.sh BUILD_DIR OUT_DIR}
out=${2:?usage: make_seeds.sh BUILD_DIR OUT_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
data=${BATCHLM_DATA:-$root/data}
[ -f "$data/gsm8k/test.jsonl" ] || data=$root/../shared/data
model=${BATCHLM_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$out"/{gguf,chat_template,sse,openai_answer,job,source,server_request,tokenizer}

"$build/tests/fuzz/make_fuzz_seeds" "$out" "$model"

# --- SSE and answers from the fake server ----------------------------------------------------
port_file=$(mktemp)
rm -f "$port_file"
"$build/bin/fake_openai_server" --port 0 --port-file "$port_file" --tokens 6 >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$port_file"' EXIT
for _ in $(seq 100); do [ -s "$port_file" ] && break; sleep 0.05; done
url="http://127.0.0.1:$(cat "$port_file")/v1/chat/completions"
chat='{"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "stream": true, "stream_options": {"include_usage": true}}'
n=0
for fault in "" crlf cr "error_event" "event_error" "malformed" "truncate" "ignore_stream" "crlf;after=1;error_event"; do
  n=$((n + 1))
  body=$(mktemp)
  curl -s -N -H 'Content-Type: application/json' ${fault:+-H "x-fake-fault: $fault"} -d "$chat" "$url" >"$body" || true
  # sse: default limits, seed byte, the stream; and one with small limits.
  { printf '\x00\x07'; cat "$body"; } >"$out/sse/capture_$n"
  { printf '\x41\x07'; cat "$body"; } >"$out/sse/capture_small_$n"
  # openai_answer, mode 0: status 200, the content type of what came back.
  if [ "$fault" = ignore_stream ]; then choice='\x08'; else choice='\x00'; fi
  { printf "\\x00$choice\\x05"; cat "$body"; } >"$out/openai_answer/stream_$n"
  rm -f "$body"
done
# A non-streaming answer (mode 1) and error responses (mode 2: status byte, headers, body).
curl -s -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "hi"}]}' "$url" |
  { printf '\x01'; cat; } >"$out/openai_answer/body_1"
for fault in "status=429;retry_after=7" "status=500;retry_after_ms=1500;should_retry=true" \
             "status=429;code=insufficient_quota" "status=503;retry_after_date=30" "status=400;no_body"; do
  n=$((n + 1))
  curl -s -i -H 'Content-Type: application/json' -H "x-fake-fault: $fault" -d "$chat" "$url" |
    tr -d '\r' | sed '1d' | { printf '\x02\x1d'; cat; } >"$out/openai_answer/error_$n"
done
printf '\x03{"choices": [{"delta": {"content": "caf\xc3\xa9 \\ud83d\\ude00 \\ud800"}}]}' >"$out/openai_answer/json_surrogate"
printf '\x03{"message": "bad \xff byte"}' >"$out/openai_answer/json_invalid_utf8"
kill $server 2>/dev/null || true

# --- Jobs ---------------------------------------------------------------------------------------
for job in "$root"/jobs/*.yaml; do cp "$job" "$out/job/$(basename "$job")"; done
printf 'input: in.jsonl\nrequest:\n  messages: [{role: user, content: "{{question}}"}]\nscoring: gsm8k\n' >"$out/job/minimal.yaml"
{ cat "$root/jobs/gsm8k.yaml"; printf '\0concurrency=8\0request.stop=[a, b]\0\x01out/x.jsonl\0\x04http://localhost:8000/v1'; } >"$out/job/gsm8k_overrides"
{ cat "$root/jobs/stories.yaml"; printf '\0synth.count=3\0backend.speculative.method=ngram\0retry.base=2s'; } >"$out/job/stories_overrides"
printf 'input: in.jsonl\nrequest:\n  stop: &s [a, b]\n  messages: [{role: user, content: &q "{{question}}"}, {role: assistant, content: *q}]\n  extra: {also: *s, deep: {x: [1, {y: *s}]}}\n' >"$out/job/anchors.yaml"
printf 'input: batch.jsonl\nbackend: {type: openai, base_url: "${OPENAI_BASE_URL:-http://x/v1}", timeouts: {idle: 500ms}}\nrequest: {extra: {response_format: {type: json_object}, n: 1}}\nscoring: {type: regex, pattern: "#### (\\\\d+)", reference_field: answer}\n' >"$out/job/batch_regex.yaml"

# --- Input lines --------------------------------------------------------------------------------
# flags byte, limit byte, the user template line, then the file.
{ printf '\x08\x05{{question}}\n'; head -n 20 "$data/gsm8k/test.jsonl"; } >"$out/source/gsm8k_template"
{ printf '\x00\x00\n'; head -n 3 "$data/gsm8k/test.jsonl" | sed 's/"question"/"prompt"/'; } >"$out/source/prompt_lines"
{ printf '\x22\x01Q: {{question}} A: {{ answer }} {{a.b.1}}\n'; head -n 5 "$data/gsm8k/train.jsonl"; } >"$out/source/few_shot"
{ printf '\x02\x00\n'
  printf '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stop": ["x"], "seed": 1, "temperature": 0.5}}\n'
  printf '{"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": " brief"}]}, {"role": "user", "content": null}], "logprobs": true}}\n'
} >"$out/source/batch"
{ printf '\x00\x00\n'; printf '{"messages": [{"role": "user", "content": "hi"}]}\r\n\n  \n{"prompt": "x"}\n'; } >"$out/source/messages_crlf"

# --- Server request bodies ----------------------------------------------------------------------
printf '\x00{"model": "smollm", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 3?"}], "max_tokens": 64, "temperature": 0, "top_p": 0.9, "top_k": 40, "seed": 1, "stop": ["\\n\\n", "####"], "stream": true, "stream_options": {"include_usage": true}}' >"$out/server_request/chat"
printf '\x00{"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant"}], "max_completion_tokens": 5, "n": 1, "presence_penalty": 0, "logit_bias": {}, "logprobs": false, "tools": [], "response_format": {"type": "text"}}' >"$out/server_request/chat_fields"
printf '\x01{"model": "smollm", "prompt": "Once upon a time", "max_tokens": 16, "echo": false, "suffix": "", "best_of": 1, "stop": "\\n"}' >"$out/server_request/completion"
printf '\x01{"prompt": ["one"], "max_tokens": 1e2, "seed": -9223372036854775808}' >"$out/server_request/completion_array"

# --- Tokenizer texts ----------------------------------------------------------------------------
head -n 3 "$data/gsm8k/test.jsonl" | sed -n 's/.*"question": "\([^"]*\)".*/\1/p' | head -n 3 >"$out/tokenizer/gsm8k_questions"
printf '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n' >"$out/tokenizer/chatml"
printf 'Emoji: \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 1,234.5 \t\n  def f(x):\n    return x**2\n' >"$out/tokenizer/scripts"
printf 'bytes \xff\xfe \xe2\x82 \xc0\x80 \x04\x06 tail \xf0\x9f\x98' >"$out/tokenizer/invalid"

for d in "$out"/*/; do echo "$(basename "$d"): $(ls "$d" | wc -l) seeds"; done
