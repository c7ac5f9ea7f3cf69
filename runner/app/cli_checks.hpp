#pragma once
// Checks for the commands' numeric flags, with messages in the job file's words:
// "--concurrency: must be >= 1, got 0", "--top-p: must be between 0 and 1, got 2".

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

namespace batchlm::app {

namespace detail {

inline std::string show(double v) {
  char text[32];
  // Whole numbers in full (1048576, not 1.04858e+06).
  if (v == std::floor(v) && std::abs(v) < 1e15) std::snprintf(text, sizeof text, "%.0f", v);
  else std::snprintf(text, sizeof text, "%g", v);
  return text;
}

// The message for a value outside [min, max] (max infinite: no upper bound but the type's,
// `largest`, or a long long's), or "". A value past the upper bound is said to be too large.
inline std::string check_number(const std::string& text, double min, double max, bool integer,
                                double largest = INFINITY) {
  double value = 0;
  bool parsed = false;
  const char* end = text.data() + text.size();
  if (integer) {
    long long n = 0;
    const auto [at, err] = std::from_chars(text.data(), end, n);
    parsed = err == std::errc() && at == end;
    value = static_cast<double>(n);
    if (err == std::errc::result_out_of_range && at == end && std::isinf(max) && !text.starts_with('-'))
      return "too large: the largest allowed is " + (std::isinf(largest) ? std::to_string(std::numeric_limits<long long>::max()) : show(largest)) +
             ", got " + text;
    if (err == std::errc::result_out_of_range && at == end) {
      parsed = true;  // out of range, not malformed
      value = text.starts_with('-') ? -INFINITY : INFINITY;
    }
    if (parsed && std::isinf(max) && value > largest)
      return "too large: the largest allowed is " + show(largest) + ", got " + text;
  } else {
    const auto [at, err] = std::from_chars(text.data(), end, value);
    parsed = err == std::errc() && at == end && std::isfinite(value);
  }
  if (parsed && value >= min && value <= max) return {};
  std::string message = std::isinf(max) ? "must be >= " : "must be between ";
  message.append(show(min));
  if (!std::isinf(max)) message.append(" and ").append(show(max));
  if (!parsed) message.append(integer ? " (an integer)" : " (a number)");
  message.append(", got ");
  if (!parsed) message.push_back('\'');
  message.append(text);
  if (!parsed) message.push_back('\'');
  return message;
}

}  // namespace detail

// largest: the most the option's type holds (an int's 2147483647), said to be the largest allowed.
inline CLI::Validator at_least(double min, bool integer = true, double largest = INFINITY) {
  return CLI::Validator(
      [=](std::string& text) { return detail::check_number(text, min, INFINITY, integer, largest); },
      (integer ? "INT>=" : "NUMBER>=") + detail::show(min));
}

inline CLI::Validator between(double min, double max, bool integer = true) {
  return CLI::Validator(
      [=](std::string& text) { return detail::check_number(text, min, max, integer); },
      (integer ? "INT in " : "NUMBER in ") + detail::show(min) + ".." + detail::show(max));
}

// An option that takes a value takes the next argument whatever it is, so `-o --dry-run` would
// write to a file named "--dry-run" and send every request. A value that is one of the command's
// own options, or of a command above it (--version), is refused instead, in every command below
// `cmd`.
inline void refuse_options_as_values(CLI::App& cmd) {
  for (CLI::Option* option : cmd.get_options()) {
    if (!option->nonpositional() || option->get_type_size_max() == 0) continue;  // positionals, flags
    option->check(CLI::Validator(
        [&cmd](std::string& value) -> std::string {
          if (value.size() < 2 || value[0] != '-') return {};
          // The command's options, and those of the commands above it (--version).
          const std::string name = value.substr(0, value.find('='));
          for (const CLI::App* at = &cmd; at != nullptr; at = at->get_parent())
            if (at->get_option_no_throw(name) != nullptr) return "value missing: " + value + " is an option, not a value";
          return {};
        },
        ""));
  }
  for (CLI::App* sub : cmd.get_subcommands({})) refuse_options_as_values(*sub);
}

// Compute threads for the engine: more than the machine's hardware threads only makes the
// kernel threads, which spin between the steps of a forward pass, take turns on the cores
// (many times slower), so a larger request is lowered, with a note. 0 stays 0 (one per
// hardware thread).
inline int usable_threads(int requested) {
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  if (requested <= hardware || hardware <= 0) return requested;
  std::fprintf(stderr, "batchlm: note: %d compute threads asked for, but this machine runs %d at once; using %d\n",
               requested, hardware, hardware);
  return hardware;
}

}  // namespace batchlm::app
