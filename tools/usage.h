#pragma once
// Usage errors for the `memfit` CLI: exit 2, found before any work.
//
// Every numeric flag is read through integer() or real(), which parse the
// text themselves (no overflow, no saturation) and say "--batch must be a
// positive integer, got 0". Checks that need more than one flag run in each
// command's validate step and throw UsageError; as_usage turns a library
// check's c10::Error into one.

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace memfit::tools {

/// A usage error: the CLI prints it in one line and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Throws UsageError with the parts joined when `ok` is false.
template <class... Parts>
void usage_check(bool ok, const Parts&... parts) {
  if (!ok) throw UsageError(c10::str(parts...));
}

/// Runs `check`; a c10::Error it throws becomes a UsageError.
template <class F>
auto as_usage(F&& check) -> decltype(check()) {
  try {
    return check();
  } catch (const c10::Error& e) {
    throw UsageError(e.msg());
  }
}

/// A validator for an integer flag in [lo, hi].
CLI::Validator integer(int64_t lo, int64_t hi);

/// A validator for a finite real flag in [lo, hi], or (lo, hi] when `open_lo`.
CLI::Validator real(double lo, double hi, bool open_lo = false);

/// A validator for a path flag (`what`: "file" or "folder") that refuses an empty string.
CLI::Validator path(const std::string& what);

/// A validator for a memory size (512MiB, 2GiB, bytes) that is positive.
CLI::Validator memory_size();

/// A validator named `name` (e.g. "SCHEDULE") that runs `parse` on the
/// flag's text: the c10::Error it throws is the flag's error, in its words.
CLI::Validator parsed_by(std::function<void(const std::string&)> parse, const std::string& name);

/// CLI11's "--flag: message" for a failed validator, as "--flag message".
std::string plain_parse_error(const std::string& what);

/// A library message with its C++ option names (TrainerOptions::batch_size)
/// replaced by the flags that set them (--batch).
std::string with_flag_names(std::string message);

/// Checks that `output` can be written and is none of `inputs`.
void check_output(const std::string& flag, const std::string& output, const std::vector<std::string>& inputs);
/// Whether `a` and `b` name one file: the same file where both exist, else the same resolved path.
bool same_file(const std::string& a, const std::string& b);
/// Usage error when `output` (of `flag`) is one of `others`, the outputs of `other_flag`.
void check_outputs_apart(const std::string& flag, const std::string& output, const std::string& other_flag,
                         const std::vector<std::string>& others);

/// This machine's physical memory, in bytes.
int64_t physical_memory();

} // namespace memfit::tools
