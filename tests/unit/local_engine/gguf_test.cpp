#include "batchlm/local_engine/gguf.hpp"

#include <sys/stat.h>
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "batchlm/core/types.hpp"
#include "gguf_writer.hpp"

namespace batchlm::local_engine::gguf {
namespace {

namespace fs = std::filesystem;
using batchlm::testing::GgufType;
using batchlm::testing::GgufValue;
using batchlm::testing::GgufWriter;
using kernels::DType;

constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();

// The little-endian bytes of some u64s, for hand-made metadata values.
std::vector<std::byte> bytes_of(std::initializer_list<std::uint64_t> u64s) {
  std::vector<std::byte> out(u64s.size() * 8);
  std::memcpy(out.data(), std::data(u64s), out.size());
  return out;
}

std::vector<std::byte> random_bytes(std::size_t n, std::mt19937& rng) {
  std::vector<std::byte> out(n);
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// A small valid file: a few metadata keys of different types and three tensors, F32, Q8_0 and
// F16 (about 500 bytes), the subject of the corruption tests.
GgufWriter small_model() {
  std::vector<float> a(8), b(64), c(8);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::sin(static_cast<float>(i));
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = -static_cast<float>(i);
  GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama"))
      .add("count", GgufValue::u32(7))
      .add("scale", GgufValue::f32(0.25f))
      .add("names", GgufValue::str_array({"x", "yy"}))
      .add_tensor("a", DType::F32, {4, 2}, a)
      .add_tensor("b", DType::Q8_0, {32, 2}, b)
      .add_tensor("c", DType::F16, {8}, c);
  return writer;
}

class GgufTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("gguf_test_" + std::to_string(::getpid()) + "_" + test->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  fs::path path(const std::string& name = "model.gguf") const { return dir_ / name; }

  File write_and_open(const GgufWriter& writer) {
    writer.write(path());
    return File::open(path());
  }

  // Opens `file` expecting a gguf::Error and returns its message, which must start with the
  // path; an empty string (and a test failure) when the file opens.
  static std::string open_error(const fs::path& file) {
    try {
      File::open(file);
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(file.string() + ": ", 0), 0u) << message;
      return message;
    }
    ADD_FAILURE() << file << " opened without an error";
    return "";
  }

  // Writes `writer` and expects opening it to fail with a message containing every part.
  void expect_error(const GgufWriter& writer, std::initializer_list<std::string> parts) {
    writer.write(path());
    const std::string message = open_error(path());
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }

  fs::path dir_;
};

// Runs `f`, expecting a gguf::Error whose message contains every part.
template <class F>
void expect_throws(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no gguf::Error thrown";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }
}

// ---- Metadata ------------------------------------------------------------------------------

TEST_F(GgufTest, RoundTripsEveryMetadataTypeInFileOrder) {
  GgufWriter writer;
  writer.add("u8", GgufValue::u8(255))
      .add("i8", GgufValue::i8(-128))
      .add("u16", GgufValue::u16(65535))
      .add("i16", GgufValue::i16(-32768))
      .add("u32", GgufValue::u32(4294967295u))
      .add("i32", GgufValue::i32(std::numeric_limits<std::int32_t>::min()))
      .add("f32", GgufValue::f32(1.5f))
      .add("bool.true", GgufValue::boolean(true))
      .add("bool.false", GgufValue::boolean(false))
      .add("string", GgufValue::str("h\xc3\xa9llo, world"))
      .add("string.empty", GgufValue::str(""))
      .add("u64", GgufValue::u64(kU64Max))
      .add("i64", GgufValue::i64(std::numeric_limits<std::int64_t>::min()))
      .add("f64", GgufValue::f64(-2.25e300));
  const File file = write_and_open(writer);

  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  EXPECT_TRUE(file.tensors().empty());
  const std::vector<std::string> keys = {"u8",         "i8",        "u16",    "i16",
                                         "u32",        "i32",       "f32",    "bool.true",
                                         "bool.false", "string",    "string.empty",
                                         "u64",        "i64",       "f64"};
  ASSERT_EQ(file.metadata().size(), keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(file.metadata()[i].first, keys[i]);

  EXPECT_EQ(file.require("u8").type, ValueType::U8);
  EXPECT_EQ(file.get_u64("u8"), 255u);
  EXPECT_EQ(file.require("i8").type, ValueType::I8);
  EXPECT_EQ(file.require("i8").as_i64("i8"), -128);
  EXPECT_EQ(file.get_u64("u16"), 65535u);
  EXPECT_EQ(file.require("i16").as_i64("i16"), -32768);
  EXPECT_EQ(file.get_u64("u32"), 4294967295u);
  EXPECT_EQ(file.require("i32").as_i64("i32"), std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(file.require("f32").type, ValueType::F32);
  EXPECT_EQ(file.get_f64("f32"), 1.5);
  EXPECT_EQ(file.find_bool("bool.true"), true);
  EXPECT_EQ(file.find_bool("bool.false"), false);
  EXPECT_EQ(file.get_string("string"), "h\xc3\xa9llo, world");
  EXPECT_EQ(file.get_string("string.empty"), "");
  EXPECT_EQ(file.get_u64("u64"), kU64Max);
  EXPECT_EQ(file.require("i64").as_i64("i64"), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(file.require("f64").type, ValueType::F64);
  EXPECT_EQ(file.get_f64("f64"), -2.25e300);
}

TEST_F(GgufTest, RoundTripsArraysOfEveryTypeAndNestedArrays) {
  const std::vector<std::int32_t> ints = {-1, 0, 2147483647};
  const std::vector<float> floats = {0.5f, -3.0f};
  GgufWriter writer;
  writer.add("strings", GgufValue::str_array({"a", "", "ccc"}))
      .add("i32s", GgufValue::i32_array(ints))
      .add("f32s", GgufValue::f32_array(floats))
      .add("u8s", GgufValue::array(GgufType::U8, {GgufValue::u8(1), GgufValue::u8(2)}))
      .add("i8s", GgufValue::array(GgufType::I8, {GgufValue::i8(-3)}))
      .add("u16s", GgufValue::array(GgufType::U16, {GgufValue::u16(4)}))
      .add("i16s", GgufValue::array(GgufType::I16, {GgufValue::i16(-5)}))
      .add("u64s", GgufValue::array(GgufType::U64, {GgufValue::u64(kU64Max)}))
      .add("i64s", GgufValue::array(GgufType::I64, {GgufValue::i64(-7)}))
      .add("f64s", GgufValue::array(GgufType::F64, {GgufValue::f64(0.125)}))
      .add("bools", GgufValue::array(GgufType::Bool, {GgufValue::boolean(true), GgufValue::boolean(false)}))
      .add("empty", GgufValue::array(GgufType::U32, {}))
      .add("nested", GgufValue::array(GgufType::Array,
                                      {GgufValue::i32_array(ints), GgufValue::str_array({"x"}),
                                       GgufValue::array(GgufType::Array,
                                                        {GgufValue::array(GgufType::U8, {})})}));
  const File file = write_and_open(writer);

  const Array& strings = file.require("strings").as_array("strings");
  EXPECT_EQ(strings.element_type, ValueType::String);
  ASSERT_EQ(strings.items.size(), 3u);
  EXPECT_EQ(strings.items[0].as_string("strings"), "a");
  EXPECT_EQ(strings.items[1].as_string("strings"), "");
  EXPECT_EQ(strings.items[2].as_string("strings"), "ccc");

  const Array& i32s = file.require("i32s").as_array("i32s");
  EXPECT_EQ(i32s.element_type, ValueType::I32);
  ASSERT_EQ(i32s.items.size(), 3u);
  for (std::size_t i = 0; i < ints.size(); ++i) EXPECT_EQ(i32s.items[i].as_i64("i32s"), ints[i]);

  const Array& f32s = file.require("f32s").as_array("f32s");
  ASSERT_EQ(f32s.items.size(), 2u);
  EXPECT_EQ(f32s.items[0].as_f64("f32s"), 0.5);
  EXPECT_EQ(f32s.items[1].as_f64("f32s"), -3.0);

  const auto single = [&](const char* key, ValueType type) -> const Value& {
    const Array& array = file.require(key).as_array(key);
    EXPECT_EQ(array.element_type, type) << key;
    EXPECT_FALSE(array.items.empty()) << key;
    return array.items.at(0);
  };
  EXPECT_EQ(single("u8s", ValueType::U8).as_u64("u8s"), 1u);
  EXPECT_EQ(file.require("u8s").as_array("u8s").items.at(1).as_u64("u8s"), 2u);
  EXPECT_EQ(single("i8s", ValueType::I8).as_i64("i8s"), -3);
  EXPECT_EQ(single("u16s", ValueType::U16).as_u64("u16s"), 4u);
  EXPECT_EQ(single("i16s", ValueType::I16).as_i64("i16s"), -5);
  EXPECT_EQ(single("u64s", ValueType::U64).as_u64("u64s"), kU64Max);
  EXPECT_EQ(single("i64s", ValueType::I64).as_i64("i64s"), -7);
  EXPECT_EQ(single("f64s", ValueType::F64).as_f64("f64s"), 0.125);
  EXPECT_TRUE(single("bools", ValueType::Bool).as_bool("bools"));
  EXPECT_FALSE(file.require("bools").as_array("bools").items.at(1).as_bool("bools"));

  const Array& empty = file.require("empty").as_array("empty");
  EXPECT_EQ(empty.element_type, ValueType::U32);
  EXPECT_TRUE(empty.items.empty());

  const Array& nested = file.require("nested").as_array("nested");
  EXPECT_EQ(nested.element_type, ValueType::Array);
  ASSERT_EQ(nested.items.size(), 3u);
  const Array& inner_ints = nested.items[0].as_array("nested");
  EXPECT_EQ(inner_ints.element_type, ValueType::I32);
  ASSERT_EQ(inner_ints.items.size(), 3u);
  EXPECT_EQ(inner_ints.items[2].as_i64("nested"), 2147483647);
  const Array& inner_strings = nested.items[1].as_array("nested");
  ASSERT_EQ(inner_strings.items.size(), 1u);
  EXPECT_EQ(inner_strings.items[0].as_string("nested"), "x");
  const Array& deeper = nested.items[2].as_array("nested");
  ASSERT_EQ(deeper.items.size(), 1u);
  EXPECT_EQ(deeper.items[0].as_array("nested").element_type, ValueType::U8);
}

TEST_F(GgufTest, AccessorsConvertWhereTheValueFitsAndNameTheKeyAndTypeWhereNot) {
  GgufWriter writer;
  writer.add("negative", GgufValue::i8(-1))
      .add("big", GgufValue::u64(kU64Max))
      .add("small", GgufValue::u16(300))
      .add("count", GgufValue::i32(12))
      .add("text", GgufValue::str("llama"))
      .add("flag", GgufValue::boolean(true))
      .add("ratio", GgufValue::f32(0.5f));
  const File file = write_and_open(writer);

  EXPECT_EQ(file.get_u64("count"), 12u);          // a non-negative signed integer
  EXPECT_EQ(file.require("small").as_i64("small"), 300);
  EXPECT_EQ(file.get_f64("count"), 12.0);          // integers convert to double
  EXPECT_EQ(file.find_f64("ratio"), 0.5);
  EXPECT_EQ(file.find_u64("small"), 300u);
  EXPECT_EQ(file.find_string("text"), "llama");
  EXPECT_FALSE(file.find_u64("absent"));
  EXPECT_FALSE(file.find_f64("absent"));
  EXPECT_FALSE(file.find_string("absent"));
  EXPECT_FALSE(file.find_bool("absent"));
  EXPECT_EQ(file.find("absent"), nullptr);

  const Value& negative = file.require("negative");
  expect_throws([&] { negative.as_u64("negative"); }, {"'negative'", "-1", "non-negative"});
  const Value& big = file.require("big");
  expect_throws([&] { big.as_i64("big"); }, {"'big'", "18446744073709551615", "does not fit"});
  const Value& text = file.require("text");
  expect_throws([&] { text.as_u64("text"); }, {"'text'", "has type string", "integer"});
  expect_throws([&] { text.as_i64("text"); }, {"'text'", "has type string"});
  expect_throws([&] { text.as_f64("text"); }, {"'text'", "has type string"});
  expect_throws([&] { text.as_bool("text"); }, {"'text'", "has type string", "expected bool"});
  expect_throws([&] { text.as_array("text"); }, {"'text'", "has type string", "expected array"});
  const Value& flag = file.require("flag");
  expect_throws([&] { flag.as_string("flag"); }, {"'flag'", "has type bool", "expected string"});
  expect_throws([&] { flag.as_u64("flag"); }, {"'flag'", "has type bool"});
  const Value& ratio = file.require("ratio");
  expect_throws([&] { ratio.as_u64("ratio"); }, {"'ratio'", "has type f32"});

  // Through File, the path comes first.
  const std::string prefix = path().string() + ": ";
  expect_throws([&] { file.get_u64("absent"); }, {prefix + "missing metadata key 'absent'"});
  expect_throws([&] { file.get_string("count"); }, {prefix + "metadata key 'count' has type i32"});
  expect_throws([&] { file.get_u64("negative"); }, {prefix + "metadata key 'negative' is -1"});
  expect_throws([&] { file.get_f64("flag"); }, {prefix + "metadata key 'flag' has type bool"});
  expect_throws([&] { file.find_u64("text"); }, {prefix + "metadata key 'text' has type string"});
  expect_throws([&] { file.find_string("count"); }, {prefix, "'count'"});
  expect_throws([&] { file.find_bool("count"); }, {prefix, "'count'"});
  expect_throws([&] { file.find_f64("text"); }, {prefix, "'text'"});
}

// ---- Tensors -------------------------------------------------------------------------------

TEST_F(GgufTest, TensorsOfEveryTypeHaveTheirBytesAlignedAtEveryAlignment) {
  struct Case {
    const char* name;
    DType type;
    std::vector<std::int64_t> shape;
  };
  const std::vector<Case> cases = {
      {"f32", DType::F32, {3}},
      {"f16", DType::F16, {5, 2}},
      {"bf16", DType::BF16, {7, 1, 2}},
      {"q8_0", DType::Q8_0, {64, 3}},
      {"q8_1", DType::Q8_1, {32, 2}},
      {"q4_0", DType::Q4_0, {32, 2, 2, 1}},
      {"q4_1", DType::Q4_1, {96}},
  };
  // 32 is the default (no general.alignment key); the others are written.
  for (const std::uint32_t alignment : {32u, 1u, 8u, 64u, 256u, 4096u}) {
    SCOPED_TRACE("alignment " + std::to_string(alignment));
    std::mt19937 rng(alignment);
    GgufWriter writer;
    writer.add("general.architecture", GgufValue::str("test"));
    if (alignment != 32) writer.set_alignment(alignment);
    std::vector<std::vector<std::byte>> contents;
    for (const Case& c : cases) {
      std::int64_t rows = 1;
      for (std::size_t i = 1; i < c.shape.size(); ++i) rows *= c.shape[i];
      contents.push_back(random_bytes(kernels::row_bytes(c.type, c.shape[0]) * rows, rng));
      writer.add_tensor(c.name, c.type, c.shape, contents.back());
    }
    const GgufWriter::Encoded encoded = writer.encode();
    const File file = write_and_open(writer);

    EXPECT_EQ(file.alignment(), alignment);
    EXPECT_EQ(file.file_size(), encoded.bytes.size());
    ASSERT_EQ(file.tensors().size(), cases.size());
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const TensorInfo& t = file.tensors()[i];
      SCOPED_TRACE(c.name);
      EXPECT_EQ(&file.tensor(c.name, c.shape), &t);
      EXPECT_EQ(t.name, c.name);
      EXPECT_EQ(t.type, c.type);
      EXPECT_EQ(t.shape, c.shape);
      EXPECT_EQ(t.offset, encoded.tensor_offsets[i]);
      EXPECT_EQ(t.offset % alignment, 0u);
      EXPECT_EQ(t.n_bytes, contents[i].size());
      std::int64_t n = 1;
      for (std::int64_t d : c.shape) n *= d;
      EXPECT_EQ(t.n_elements, static_cast<std::uint64_t>(n));
      EXPECT_EQ(t.cols(), c.shape[0]);
      EXPECT_EQ(t.rows(), n / c.shape[0]);
      // The mapping starts on a page boundary, so file alignment is address alignment.
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data) % alignment, 0u);
      EXPECT_EQ(t.data - file.tensors()[0].data,
                static_cast<std::ptrdiff_t>(t.offset - file.tensors()[0].offset));
      EXPECT_EQ(std::memcmp(t.data, contents[i].data(), t.n_bytes), 0);
      EXPECT_EQ(std::memcmp(t.data, encoded.bytes.data() + encoded.data_start + t.offset, t.n_bytes), 0);
    }
  }
}

TEST_F(GgufTest, WriterQuantizesWithTheGgmlBlockFormulas) {
  // One block of -16..15: Q8_0 d = amax / 127 = 16/127, q(-16) = -127.
  std::vector<float> ramp(32);
  for (int j = 0; j < 32; ++j) ramp[static_cast<std::size_t>(j)] = static_cast<float>(j - 16);
  kernels::BlockQ8_0 q8;
  std::memcpy(&q8, batchlm::testing::quantize(DType::Q8_0, ramp).data(), sizeof q8);
  EXPECT_EQ(q8.d, kernels::fp32_to_fp16(16.0f / 127.0f));
  EXPECT_EQ(q8.qs[0], -127);
  EXPECT_EQ(q8.qs[16], 0);
  EXPECT_EQ(q8.qs[31], static_cast<std::int8_t>(std::round(15.0f * 127.0f / 16.0f)));

  // Q4_0: the value of largest magnitude is -16, so d = -16 / -8 = 2; q = min(15, x/d + 8.5).
  kernels::BlockQ4_0 q4;
  std::memcpy(&q4, batchlm::testing::quantize(DType::Q4_0, ramp).data(), sizeof q4);
  EXPECT_EQ(q4.d, kernels::fp32_to_fp16(2.0f));
  EXPECT_EQ(q4.qs[0] & 0x0f, 0);        // element 0: -16 / 2 + 8.5 = 0.5 -> 0
  EXPECT_EQ(q4.qs[0] >> 4, 8);          // element 16: 0 / 2 + 8.5 -> 8
  EXPECT_EQ(q4.qs[15] >> 4, 15);        // element 31: 15 / 2 + 8.5 = 16 -> clamped to 15

  // Q4_1 over 0..31: m = 0, d = 31/15, q = (x - m)/d + 0.5.
  std::vector<float> up(32);
  for (int j = 0; j < 32; ++j) up[static_cast<std::size_t>(j)] = static_cast<float>(j);
  kernels::BlockQ4_1 q41;
  std::memcpy(&q41, batchlm::testing::quantize(DType::Q4_1, up).data(), sizeof q41);
  EXPECT_EQ(q41.d, kernels::fp32_to_fp16(31.0f / 15.0f));
  EXPECT_EQ(q41.m, kernels::fp32_to_fp16(0.0f));
  EXPECT_EQ(q41.qs[0] & 0x0f, 0);
  EXPECT_EQ(q41.qs[15] >> 4, 15);

  // Through a file and back, random data stays within each format's error.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(64 * 8);
  for (float& v : values) v = normal(rng);
  const std::vector<std::pair<DType, double>> bounds = {
      {DType::F32, 0.0},   {DType::F16, 1e-3},  {DType::BF16, 5e-3},
      {DType::Q8_0, 1e-2}, {DType::Q4_0, 0.15}, {DType::Q4_1, 0.15}};
  GgufWriter writer;
  for (const auto& [type, bound] : bounds) {
    writer.add_tensor(std::string(kernels::to_string(type)), type, {64, 8}, values);
  }
  const File file = write_and_open(writer);
  for (const auto& [type, bound] : bounds) {
    const TensorInfo& t = file.tensor(kernels::to_string(type), std::vector<std::int64_t>{64, 8});
    const auto restored = batchlm::testing::dequantize(
        type, std::span(t.data, t.n_bytes), static_cast<std::int64_t>(t.n_elements));
    double error = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      error += (restored[i] - values[i]) * (restored[i] - values[i]);
      norm += values[i] * values[i];
    }
    EXPECT_LE(std::sqrt(error / norm), bound) << kernels::to_string(type);
  }
}

TEST_F(GgufTest, MovedFileKeepsItsMappingAndPointers) {
  File file = write_and_open(small_model());
  const std::byte* data = file.tensor("b").data;
  File moved = std::move(file);
  EXPECT_EQ(moved.tensor("b").data, data);
  EXPECT_EQ(moved.path(), path());
  EXPECT_EQ(moved.get_u64("count"), 7u);

  small_model().write(path("other.gguf"));
  File other = File::open(path("other.gguf"));
  other = std::move(moved);  // unmaps other's mapping, takes moved's
  EXPECT_EQ(other.tensor("b").data, data);
  EXPECT_EQ(other.path(), path());
  EXPECT_EQ(std::memcmp(data, other.tensor("b").data, other.tensor("b").n_bytes), 0);
}

// A model cut short while it is mapped (written over in place) faults on the next read of its
// lost pages. The process still dies of SIGBUS, but says first which file it was and how to
// replace a model in use.
TEST_F(GgufTest, AModelCutShortWhileMappedIsNamedWhenItsPagesAreRead) {
  int err[2];
  ASSERT_EQ(::pipe(err), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(err[1], STDERR_FILENO);
    ::close(err[0]);
    File file = write_and_open(small_model());
    const std::byte* data = file.tensor("b").data;
    if (::truncate(path().c_str(), 0) != 0) ::_exit(3);
    volatile std::byte read = data[0];  // the page is gone: SIGBUS
    (void)read;
    ::_exit(4);
  }
  ::close(err[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = ::read(err[0], buf, sizeof buf)) > 0;) said.append(buf, static_cast<std::size_t>(n));
  ::close(err[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  EXPECT_EQ(WTERMSIG(status), SIGBUS);
  EXPECT_NE(said.find(path().string() + " was cut short while in use"), std::string::npos) << said;
  EXPECT_NE(said.find("rename it over the old"), std::string::npos) << said;
}

// A SIGBUS another process sends (no fault) still ends the process, unremarked, as without the
// handler a mapped model installs.
TEST_F(GgufTest, ASentSigbusStillEndsTheProcess) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    File file = write_and_open(small_model());
    ::kill(::getpid(), SIGBUS);
    ::_exit(4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  EXPECT_EQ(WTERMSIG(status), SIGBUS);
}

TEST_F(GgufTest, TensorLookupNamesTheMissingTensorOrTheShapes) {
  const File file = write_and_open(small_model());
  EXPECT_EQ(file.find_tensor("missing"), nullptr);
  EXPECT_NE(file.find_tensor("a"), nullptr);
  EXPECT_EQ(file.tensor("a").shape, (std::vector<std::int64_t>{4, 2}));
  const std::string prefix = path().string() + ": ";
  expect_throws([&] { file.tensor("missing"); }, {prefix + "missing tensor 'missing'"});
  expect_throws([&] { file.tensor("a", std::vector<std::int64_t>{2, 4}); },
                {prefix + "tensor 'a' has shape [4, 2], expected [2, 4]"});
  expect_throws([&] { file.tensor("c", std::vector<std::int64_t>{8, 1}); },
                {prefix + "tensor 'c' has shape [8], expected [8, 1]"});
  expect_throws([&] { file.fail("n_head 3 does not divide n_embd 64"); },
                {prefix + "n_head 3 does not divide n_embd 64"});
}

// ---- Errors --------------------------------------------------------------------------------

TEST_F(GgufTest, RejectsMissingFilesAndDirectories) {
  EXPECT_NE(open_error(path("absent.gguf")).find("cannot open"), std::string::npos);
  EXPECT_NE(open_error(dir_).find("not a regular file"), std::string::npos);
  // A named pipe with no writer would block open() forever: refused without opening it.
  const std::string fifo = path("pipe.gguf");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(open_error(fifo).find("not a regular file"), std::string::npos);
}

TEST_F(GgufTest, RejectsEmptyFileAndBadMagic) {
  batchlm::testing::write_file(path(), {});
  EXPECT_NE(open_error(path()).find("the file is empty (0 bytes), not a GGUF model"), std::string::npos);
  expect_error(small_model().set_magic("GGML"), {"bad magic 'GGML'", "not a GGUF file"});
  // Bytes outside printable ASCII are shown escaped.
  expect_error(small_model().set_magic("\x7f" "ELF"), {"bad magic '\\x7fELF'"});
}

TEST_F(GgufTest, RejectsUnsupportedVersions) {
  expect_error(small_model().set_version(1), {"unsupported GGUF version 1", "versions 2 and 3"});
  expect_error(small_model().set_version(4), {"unsupported GGUF version 4"});
  expect_error(small_model().set_version(0x03000000), {"big-endian"});
  // Version 2 has the same layout as 3.
  EXPECT_EQ(write_and_open(small_model().set_version(2)).version(), 2u);
}

TEST_F(GgufTest, TruncationNamesTheByteAndWhatWasBeingRead) {
  GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama")).add("count", GgufValue::u32(7));
  const auto bytes = writer.encode().bytes;
  // The u32 value of "count" starts after the key's text and its 4-byte type id.
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const std::size_t value_at = text.find("count") + 5 + 4;
  writer.write_truncated(path(), value_at + 2);
  const std::string message = open_error(path());
  EXPECT_NE(message.find("truncated at byte " + std::to_string(value_at + 2) +
                         " while reading metadata key 'count'"),
            std::string::npos)
      << message;

  // In the tensor table.
  const GgufWriter model = small_model();
  const auto encoded = model.encode();
  const std::string_view model_text(reinterpret_cast<const char*>(encoded.bytes.data()),
                                    encoded.bytes.size());
  // Tensor "b"'s name is the 1-byte string after its 8-byte length; cut inside its dims.
  const std::string b_entry("\x01\0\0\0\0\0\0\0b", 9);
  const std::size_t b_at = model_text.find(b_entry);
  ASSERT_NE(b_at, std::string_view::npos);
  model.write_truncated(path(), b_at + 9 + 4 + 3);
  EXPECT_NE(open_error(path()).find("while reading tensor 'b'"), std::string::npos);

  // In the header.
  model.write_truncated(path(), 10);
  EXPECT_NE(open_error(path()).find("truncated at byte 10 while reading the header"),
            std::string::npos);
}

TEST_F(GgufTest, RejectsDuplicateKeysAndTensorNames) {
  expect_error(small_model().add("count", GgufValue::u32(8)), {"duplicate metadata key 'count'"});
  std::vector<float> values(4, 1.0f);
  expect_error(small_model().add_tensor("a", DType::F32, {4}, values), {"duplicate tensor name 'a'"});
}

TEST_F(GgufTest, RejectsInvalidKeysAndNames) {
  expect_error(small_model().add("", GgufValue::u8(1)), {"metadata key #4 is an empty key"});
  expect_error(small_model().add("bad\nkey", GgufValue::u8(1)), {"'bad\\x0akey'", "control characters"});
  std::vector<float> values(4, 1.0f);
  expect_error(small_model().add_tensor("", DType::F32, {4}, values), {"tensor info #3 has an empty name"});
}

TEST_F(GgufTest, RejectsUnknownValueTypesAndInvalidValues) {
  expect_error(small_model().add("weird", GgufValue::raw(13, {})),
               {"metadata key 'weird' has unknown value type 13"});
  std::vector<std::byte> element_99 = {std::byte{99}, std::byte{0}, std::byte{0}, std::byte{0}};
  const auto zero = bytes_of({0});
  element_99.insert(element_99.end(), zero.begin(), zero.end());
  expect_error(small_model().add("list", GgufValue::raw(9, element_99)),
               {"metadata key 'list'", "unknown array element type 99"});
  expect_error(small_model().add("flag", GgufValue::raw(7, {std::byte{2}})),
               {"metadata key 'flag'", "bool value 2 is neither 0 nor 1"});
}

TEST_F(GgufTest, RejectsCountsAndLengthsLargerThanTheFile) {
  // Each would be a huge allocation if believed; each must be an error instead.
  const std::uint64_t huge = std::uint64_t{1} << 60;
  expect_error(small_model().add("text", GgufValue::raw(8, bytes_of({huge}))),
               {"while reading metadata key 'text' (a string of 1152921504606846976 bytes"});
  auto array_header = std::vector<std::byte>{std::byte{10}, std::byte{0}, std::byte{0}, std::byte{0}};
  const auto count = bytes_of({huge});
  array_header.insert(array_header.end(), count.begin(), count.end());
  expect_error(small_model().add("list", GgufValue::raw(9, array_header)),
               {"while reading metadata key 'list' (1152921504606846976 array items of at least 8 bytes"});
  expect_error(small_model().set_kv_count(huge),
               {"while reading the header (1152921504606846976 metadata keys"});
  expect_error(small_model().set_tensor_count(huge),
               {"while reading the header (1152921504606846976 tensors"});
  expect_error(small_model().set_kv_count(kU64Max), {"18446744073709551615 metadata keys"});
  // A string length that would overflow position + length.
  expect_error(small_model().add("text", GgufValue::raw(8, bytes_of({kU64Max}))),
               {"a string of 18446744073709551615 bytes"});
}

// Each array item is held as a Value of some 50 bytes: a 17 MB array of bytes would take 800 MB.
// The metadata's arrays may hold 2^24 items in all, far past any vocabulary.
TEST_F(GgufTest, LimitsTheItemsOfTheMetadatasArrays) {
  const auto u8_array = [](std::uint64_t count) {
    std::vector<std::byte> raw{std::byte{0}, std::byte{0}, std::byte{0}, std::byte{0}};  // of U8
    const auto n = bytes_of({count});
    raw.insert(raw.end(), n.begin(), n.end());
    raw.resize(raw.size() + count, std::byte{7});
    return GgufValue::raw(9, raw);
  };
  // Refused when counted, before any item is read: the test holds only the file's bytes.
  expect_error(small_model().add("a", u8_array(8)).add("b", u8_array(std::uint64_t{1} << 24)),
               {"metadata key 'b'", "more than 16777216 items", "corrupt or not a model"});
  EXPECT_NO_THROW(write_and_open(small_model().add("a", u8_array(8)).add("b", u8_array(4096))));
}

TEST_F(GgufTest, LimitsArrayNesting) {
  const auto nest = [](int levels) {
    GgufValue value = GgufValue::array(GgufType::U8, {GgufValue::u8(1)});
    for (int i = 1; i < levels; ++i) value = GgufValue::array(GgufType::Array, {value});
    return value;
  };
  EXPECT_NO_THROW(write_and_open(small_model().add("deep", nest(8))));
  expect_error(small_model().add("deep", nest(9)), {"metadata key 'deep'", "nested more than 8 deep"});
}

TEST_F(GgufTest, RejectsBadAlignment) {
  expect_error(small_model().set_alignment(0),
               {"general.alignment is 0, expected a non-zero power of two"});
  expect_error(small_model().set_alignment(48), {"general.alignment is 48"});
  expect_error(small_model().add("general.alignment", GgufValue::u64(32)),
               {"general.alignment has type u64, expected u32"});
}

// The types the engine runs have the same blocks in the reader's table as in the kernels, and
// the table knows ggml's K-quants.
TEST(TensorTypes, RunnableTypesAgreeWithTheKernels) {
  int runnable = 0;
  for (std::uint32_t id = 0; id < 64; ++id) {
    const std::optional<DType> kernel = kernels::dtype_from_id(id);
    const TensorType* type = tensor_type(id);
    if (!kernel) continue;
    ++runnable;
    ASSERT_NE(type, nullptr) << id;
    EXPECT_EQ(type->name, kernels::to_string(*kernel));
    EXPECT_EQ(type->block, kernels::block_size(*kernel)) << type->name;
    EXPECT_EQ(type->bytes, kernels::block_bytes(*kernel)) << type->name;
  }
  // F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and Q8_1 and Q8_K
  // (activations, refused as weights by File::tensor)
  EXPECT_EQ(runnable, 13);
  ASSERT_NE(tensor_type(14), nullptr);
  EXPECT_EQ(tensor_type(14)->name, "Q6_K");
  EXPECT_EQ(tensor_type(14)->bytes, 210u);
  EXPECT_EQ(tensor_type(4), nullptr);  // Q4_2, removed from ggml
}

TEST_F(GgufTest, RejectsBadTensorTypesAndShapes) {
  using Override = GgufWriter::TensorOverride;
  expect_error(small_model().override_tensor("b", Override{.type_id = 77}),
               {"tensor 'b' has unknown type id 77"});
  // A type the engine does not run is still measured by its own blocks.
  expect_error(small_model().override_tensor("b", Override{.type_id = 12}),
               {"tensor 'b' has rows of 32 elements, not a multiple of the Q4_K block size 256"});
  expect_error(small_model().override_tensor("a", Override{.dims = std::vector<std::uint64_t>{}}),
               {"tensor 'a' has n_dims 0, expected 1 to 4"});
  expect_error(small_model().override_tensor("a", Override{.dims = std::vector<std::uint64_t>{4, 2, 1, 1, 1}}),
               {"tensor 'a' has n_dims 5"});
  expect_error(small_model().override_tensor("a", Override{.n_dims = 0xffffffffu}),
               {"tensor 'a' has n_dims 4294967295"});
  expect_error(small_model().override_tensor("a", Override{.dims = std::vector<std::uint64_t>{4, 0}}),
               {"tensor 'a' dimension 1 is 0, expected a positive size"});
  expect_error(small_model().override_tensor("a", Override{.dims = std::vector<std::uint64_t>{kU64Max, 2}}),
               {"tensor 'a' dimension 0 is -1"});
  expect_error(small_model().override_tensor("a", Override{.dims = std::vector<std::uint64_t>{1u << 31, 1u << 31, 4}}),
               {"tensor 'a'", "element count overflows 64 bits"});
  // Same element count, but rows of 16 cannot hold whole Q8_0 blocks.
  expect_error(small_model().override_tensor("b", Override{.dims = std::vector<std::uint64_t>{16, 4}}),
               {"tensor 'b' has rows of 16 elements, not a multiple of the Q8_0 block size 32"});
}

TEST_F(GgufTest, RejectsMisplacedTensorData) {
  using Override = GgufWriter::TensorOverride;
  const auto offsets = small_model().encode().tensor_offsets;
  expect_error(small_model().override_tensor("b", Override{.offset = offsets[1] + 4}),
               {"tensor 'b' offset " + std::to_string(offsets[1] + 4) + " is not aligned to 32 bytes"});
  expect_error(small_model().override_tensor("c", Override{.offset = 1u << 20}),
               {"tensor 'c' data", "extends past the end of the file"});
  // An offset near 2^64 must not wrap around when its size is added.
  expect_error(small_model().override_tensor("c", Override{.offset = kU64Max - 31}),
               {"tensor 'c' data", "extends past the end of the file"});
  // A shape that claims more bytes than the file has.
  expect_error(small_model().override_tensor("c", Override{.dims = std::vector<std::uint64_t>{8, 1000}}),
               {"tensor 'c' data", "extends past the end of the file"});
  expect_error(small_model().override_tensor("c", Override{.offset = offsets[1]}),
               {"tensor 'b'", "overlaps tensor 'c'"});
  expect_error(small_model().override_tensor("a", Override{.offset = offsets[1] + 32}),
               {"tensor 'b'", "overlaps tensor 'a'"});
  // A type in the table that takes fewer bytes than the data has (Q8_0 read as Q4_0): the gap
  // it leaves before the next tensor is refused, not read as weights.
  expect_error(small_model().override_tensor("b", Override{.type_id = 2}),
               {"tensor 'b' (Q4_0, 36 bytes at offset 32 of the data section) is followed by ",
                " bytes no tensor holds before tensor 'c': a type or shape in the table does not match the data"});
}

TEST_F(GgufTest, EveryTruncationOfAValidFileIsAnError) {
  const auto bytes = small_model().encode().bytes;
  ASSERT_GT(bytes.size(), 200u);
  for (std::size_t size = 0; size < bytes.size(); ++size) {
    batchlm::testing::write_file(path(), std::span(bytes).first(size));
    try {
      File::open(path());
      ADD_FAILURE() << "a prefix of " << size << " bytes opened";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(path().string() + ": ", 0), 0u) << e.what();
    }
  }
  batchlm::testing::write_file(path(), bytes);
  EXPECT_NO_THROW(File::open(path()));
}

TEST_F(GgufTest, RandomByteFlipsInTheHeaderAndTableNeverCrash) {
  const auto encoded = small_model().encode();
  std::mt19937 rng(20240611);
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    auto bytes = encoded.bytes;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      const std::size_t at = rng() % encoded.data_start;
      // Half of the time a single bit, else a random byte (which makes large lengths likely).
      if (rng() % 2 == 0) {
        bytes[at] ^= static_cast<std::byte>(1u << (rng() % 8));
      } else {
        bytes[at] = static_cast<std::byte>(rng() & 0xff);
      }
    }
    batchlm::testing::write_file(path(), bytes);
    try {
      const File file = File::open(path());
      ++opened;
      // What opened must be consistent: every tensor lies inside the file, and touching its
      // first and last byte is safe.
      for (const TensorInfo& t : file.tensors()) {
        ASSERT_LE(t.offset + t.n_bytes, file.file_size()) << t.name;
        volatile std::byte first = t.data[0];
        volatile std::byte last = t.data[t.n_bytes - 1];
        (void)first;
        (void)last;
      }
    } catch (const Error&) {
      ++rejected;
    }
  }
  // Both outcomes occur, or the flips did not reach what they should.
  EXPECT_GT(opened, 0);
  EXPECT_GT(rejected, 0);
}

// ---- Generated and real models -------------------------------------------------------------

TEST_F(GgufTest, TinyLlamaHasTheLlamaCppLayout) {
  for (const DType weight : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1}) {
    SCOPED_TRACE(std::string(kernels::to_string(weight)));
    batchlm::testing::TinyLlamaOptions options;
    options.weight_dtype = weight;
    options.embedding_dtype = weight == DType::Q4_1 ? DType::Q8_0 : DType::F32;
    options.tied = weight == DType::Q4_1;
    const auto info = batchlm::testing::write_tiny_llama(path(), options);
    const File file = File::open(path());

    EXPECT_EQ(file.get_string("general.architecture"), "llama");
    EXPECT_EQ(file.get_u64("llama.block_count"), 2u);
    EXPECT_EQ(file.get_u64("llama.embedding_length"), 64u);
    EXPECT_EQ(file.get_u64("llama.feed_forward_length"), 128u);
    EXPECT_EQ(file.get_u64("llama.attention.head_count"), 4u);
    EXPECT_EQ(file.get_u64("llama.attention.head_count_kv"), 2u);
    EXPECT_EQ(file.get_u64("llama.context_length"), 256u);
    EXPECT_EQ(file.get_u64("llama.rope.dimension_count"), 16u);
    EXPECT_EQ(file.get_u64("llama.vocab_size"), static_cast<std::uint64_t>(info.n_vocab));
    EXPECT_FLOAT_EQ(static_cast<float>(file.get_f64("llama.attention.layer_norm_rms_epsilon")), 1e-5f);
    EXPECT_EQ(file.get_string("tokenizer.ggml.model"), "gpt2");
    EXPECT_EQ(file.get_string("tokenizer.ggml.pre"), "smollm");

    const Array& tokens = file.require("tokenizer.ggml.tokens").as_array("tokens");
    ASSERT_EQ(static_cast<std::int64_t>(tokens.items.size()), info.n_vocab);
    std::set<std::string> unique;
    for (const Value& token : tokens.items) unique.insert(token.as_string("tokens"));
    EXPECT_EQ(static_cast<std::int64_t>(unique.size()), info.n_vocab);
    EXPECT_TRUE(unique.count("\xc4\xa0"));        // "Ġ", the byte-level space
    EXPECT_TRUE(unique.count("\xc4\xa0world"));   // " world" after merges
    EXPECT_EQ(tokens.items[2].as_string("tokens"), "<|im_end|>");
    const Array& types = file.require("tokenizer.ggml.token_type").as_array("types");
    EXPECT_EQ(types.items[1].as_i64("types"), 3);
    EXPECT_EQ(types.items[100].as_i64("types"), 1);
    // Every merge joins two tokens into a third.
    for (const Value& merge : file.require("tokenizer.ggml.merges").as_array("merges").items) {
      const std::string& text = merge.as_string("merges");
      const auto space = text.find(' ');
      ASSERT_NE(space, std::string::npos) << text;
      EXPECT_TRUE(unique.count(text.substr(0, space))) << text;
      EXPECT_TRUE(unique.count(text.substr(space + 1))) << text;
      EXPECT_TRUE(unique.count(text.substr(0, space) + text.substr(space + 1))) << text;
    }

    const std::int64_t n_vocab = info.n_vocab;
    EXPECT_EQ(file.tensor("token_embd.weight", std::vector<std::int64_t>{64, n_vocab}).type,
              options.embedding_dtype);
    EXPECT_EQ(file.tensor("output_norm.weight", std::vector<std::int64_t>{64}).type, DType::F32);
    EXPECT_EQ(file.find_tensor("output.weight") == nullptr, options.tied);
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "blk." + std::to_string(layer) + ".";
      EXPECT_EQ(file.tensor(p + "attn_norm.weight", std::vector<std::int64_t>{64}).type, DType::F32);
      EXPECT_EQ(file.tensor(p + "ffn_norm.weight", std::vector<std::int64_t>{64}).type, DType::F32);
      EXPECT_EQ(file.tensor(p + "attn_q.weight", std::vector<std::int64_t>{64, 64}).type, weight);
      EXPECT_EQ(file.tensor(p + "attn_k.weight", std::vector<std::int64_t>{64, 32}).type, weight);
      EXPECT_EQ(file.tensor(p + "attn_v.weight", std::vector<std::int64_t>{64, 32}).type, weight);
      EXPECT_EQ(file.tensor(p + "attn_output.weight", std::vector<std::int64_t>{64, 64}).type, weight);
      EXPECT_EQ(file.tensor(p + "ffn_gate.weight", std::vector<std::int64_t>{64, 128}).type, weight);
      EXPECT_EQ(file.tensor(p + "ffn_up.weight", std::vector<std::int64_t>{64, 128}).type, weight);
      EXPECT_EQ(file.tensor(p + "ffn_down.weight", std::vector<std::int64_t>{128, 64}).type, weight);
    }
    EXPECT_EQ(file.tensors().size(), 2u + 9u * 2u + (options.tied ? 0u : 1u));
  }
}

TEST_F(GgufTest, TinyLlamaWeightsAreDeterministicInTheSeed) {
  const auto weights = [&](std::uint64_t seed, const std::string& name) {
    batchlm::testing::TinyLlamaOptions options;
    options.seed = seed;
    batchlm::testing::write_tiny_llama(path(name), options);
    const File file = File::open(path(name));
    const TensorInfo& t = file.tensor("blk.1.ffn_down.weight");
    return std::vector<std::byte>(t.data, t.data + t.n_bytes);
  };
  EXPECT_EQ(weights(5, "a.gguf"), weights(5, "b.gguf"));
  EXPECT_NE(weights(5, "a.gguf"), weights(6, "c.gguf"));
}

TEST_F(GgufTest, OpensSmolLm2WhenPresent) {
  const fs::path model = fs::path(BATCHLM_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model)) GTEST_SKIP() << model << " is absent; skipping the real-model check";
  const File file = File::open(model);
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.tensors().size(), 272u);
  EXPECT_EQ(file.metadata().size(), 33u);
  EXPECT_EQ(file.alignment(), 32u);
  EXPECT_EQ(file.get_string("general.architecture"), "llama");
  EXPECT_EQ(file.get_u64("llama.block_count"), 30u);
  EXPECT_EQ(file.get_u64("llama.embedding_length"), 576u);
  EXPECT_EQ(file.require("tokenizer.ggml.tokens").as_array("tokens").items.size(), 49152u);

  const TensorInfo& embedding = file.tensor("token_embd.weight", std::vector<std::int64_t>{576, 49152});
  EXPECT_EQ(embedding.type, DType::Q8_0);
  EXPECT_EQ(embedding.n_bytes, 49152u * 18u * sizeof(kernels::BlockQ8_0));
  const TensorInfo& down = file.tensor("blk.0.ffn_down.weight", std::vector<std::int64_t>{1536, 576});
  EXPECT_EQ(down.type, DType::Q4_1);
  EXPECT_EQ(down.rows(), 576);
  EXPECT_EQ(down.n_bytes, 576u * 48u * sizeof(kernels::BlockQ4_1));
  for (const TensorInfo& t : file.tensors()) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data) % 32, 0u) << t.name;
  }
}

}  // namespace
}  // namespace batchlm::local_engine::gguf

namespace batchlm::local_engine::gguf {
namespace {

// A model's strings reach error messages and `inspect`: an escape sequence recoloured the
// terminal, and a NUL cut the message short ("architecture 'll").
TEST(TerminalSafe, ControlCharactersAndBytesOutsideUtf8AreWrittenAsHex) {
  using batchlm::terminal_safe;
  EXPECT_EQ(terminal_safe("llama"), "llama");
  EXPECT_EQ(terminal_safe("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82"), "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82");
  EXPECT_EQ(terminal_safe("\x1b[31mRED\x1b[0m\r\n"), "\\x1b[31mRED\\x1b[0m\\x0d\\x0a");
  EXPECT_EQ(terminal_safe(std::string("ll\0ma", 5)), "ll\\x00ma");
  EXPECT_EQ(terminal_safe("\x7f\xc2\x9b\xff\xfe"), "\\x7f\\xc2\\x9b\\xff\\xfe");  // DEL, C1 CSI, not UTF-8
  // A right-to-left override (U+202E) and an isolate (U+2067) would reverse the rest of the line
  // on a terminal that applies bidi; Arabic letters and a zero-width joiner in an emoji stay.
  EXPECT_EQ(terminal_safe("a\xe2\x80\xae" "b\xe2\x81\xa7" "c\xe2\x80\xa8" "d"), "a\\u202eb\\u2067c\\u2028d");
  EXPECT_EQ(terminal_safe("\xd8\xb3\xd9\x84\xd8\xa7\xd9\x85 \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7"),
            "\xd8\xb3\xd9\x84\xd8\xa7\xd9\x85 \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7");
  const Error e(std::string("model.gguf: architecture 'll") + '\0' + "ma\x1b[2J' is not supported");
  EXPECT_STREQ(e.what(), "model.gguf: architecture 'll\\x00ma\\x1b[2J' is not supported");
}

}  // namespace
}  // namespace batchlm::local_engine::gguf
