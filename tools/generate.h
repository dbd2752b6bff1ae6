#pragma once
// `memfit generate`: samples text from a GPT that `memfit train --model gpt
// --save DIR` trained, and the model card (DIR/model.json) that train writes
// beside the checkpoint so that the model can be built again.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace memfit::tools {

/// What `memfit generate` was asked.
struct GenerateArgs {
  std::string resume;        ///< The folder train saved to.
  std::string prompt;        ///< Text to continue.
  int64_t tokens = 200;      ///< Bytes to generate.
  double temperature = 0.8;  ///< 0: always the likeliest byte.
  int64_t top_k = 0;         ///< Sample among the k likeliest (0: all).
  uint64_t seed = 0;
};

/// Adds the `generate` subcommand to `app`.
void add_generate_command(CLI::App& app, GenerateArgs& args);

/// Prints the prompt and its continuation; returns the exit code.
int run_generate(const GenerateArgs& args);

/// Writes `card` to DIR/model.json atomically.
void write_model_card(const std::string& dir, const nlohmann::json& card);

} // namespace memfit::tools
