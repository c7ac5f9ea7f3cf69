// Input lines (runner/src/source.cpp): a JSONL or OpenAI Batch-API input file of arbitrary
// content, read by open_source for a job whose template, format, scoring and few-shot
// settings also come from the input; then every item is drawn with next() and written out as
// the writer writes a record.
//
// Input: a flags byte, a limit byte, the first user message template up to the first newline
// (empty: the job has no template, so each line carries its own messages or prompt), then
// the input file's content. With the few-shot flag, the same file is the few-shot file.
//
// Promised: the input is accepted or refused with ConfigError naming the file and line, before
// anything is sent; an input that validated yields exactly total() items from next(), none
// of which throws. Checked: ids are unique in Batch-API files; every item has messages;
// records of the items can be written (JSON dump).

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "batchlm/client/openai.hpp"
#include "batchlm/runner/job.hpp"
#include "batchlm/runner/source.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::runner;

namespace {

std::filesystem::path scratch_file;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch_file = std::filesystem::temp_directory_path() /
                 ("batchlm_fuzz_source_" + std::to_string(::getpid()) + ".jsonl");
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove(scratch_file, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const std::uint8_t flags = input.byte();
  const std::uint8_t limit = input.byte();
  const std::string_view user_template = input.until('\n');
  const std::string_view content = input.rest();
  {
    std::ofstream out(scratch_file, std::ios::binary | std::ios::trunc);
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
  }

  JobSpec job;
  job.file = "job.yaml";
  job.name = "fuzz";
  job.input.path = scratch_file.string();
  job.input.format = (flags & 3) == 1 ? InputFormat::Jsonl : (flags & 3) == 2 ? InputFormat::Batch : InputFormat::Auto;
  if (!user_template.empty()) {
    job.request.messages = {{"system", "Answer."}, {"user", std::string(user_template)}};
  }
  if (flags & 4) job.request.model = "m-{{id}}";
  if (flags & 8) job.scoring.kind = ScoringKind::Gsm8k;
  if (flags & 16) job.limit = limit % 8;
  if (flags & 32) {
    job.few_shot.path = scratch_file.string();
    job.few_shot.count = 1 + limit % 3;
    job.few_shot.seed = limit;
  }
  job.backend.stream = (flags & 64) != 0;
  job.output.path = "out.jsonl";

  std::unique_ptr<Source> source;
  try {
    source = open_source(job);
  } catch (const ConfigError& e) {
    FUZZ_CHECK(e.file() == scratch_file.string() || e.file() == job.file, std::string("error names another file: ") + e.what());
    return 0;
  }
  const std::int64_t total = source->total();
  FUZZ_CHECK(total >= 0 && (!job.limit || total <= *job.limit), "total " + std::to_string(total));
  std::int64_t drawn = 0;
  std::set<std::string> ids;
  while (const std::optional<Item> item = source->next()) {
    ++drawn;
    FUZZ_CHECK(drawn <= total, "more items than total()");
    FUZZ_CHECK(item->id_key == item->id.dump(), "id_key is not the id");
    FUZZ_CHECK(ids.insert(item->id_key).second, "duplicate id " + item->id_key);
    FUZZ_CHECK(!item->request.messages.empty(), "an item without messages");
    FUZZ_CHECK(item->estimated_prompt_tokens >= 0, "a negative token estimate");
    // The record the writer appends for it.
    const nlohmann::json record = {{"id", item->id}, {"input", item->input}, {"output", ""}};
    (void)record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    // The request body the OpenAI client sends.
    (void)client::to_openai_body(item->request).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  FUZZ_CHECK(drawn == total, "drew " + std::to_string(drawn) + " of " + std::to_string(total) + " items");
  return 0;
}
