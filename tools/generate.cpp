#include "generate.h"
#include "usage.h"

#include "memfit/data.h"
#include "memfit/models.h"
#include "memfit/schedule.h"
#include "memfit/state.h"
#include "memfit/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

namespace memfit::tools {

void add_generate_command(CLI::App& app, GenerateArgs& a) {
  auto* cmd = app.add_subcommand("generate", "Continue a prompt with a GPT trained by `memfit train --model gpt --save DIR`");
  cmd->add_option("--resume", a.resume, "The folder `memfit train --save` wrote (checkpoint.pt and model.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--prompt", a.prompt, "Text to continue")->required();
  cmd->add_option("--tokens", a.tokens, "Bytes to generate")->check(integer(1, 1 << 20))->capture_default_str();
  cmd->add_option("--temperature", a.temperature, "Sampling temperature (0: always the likeliest byte)")
      ->check(real(0, 10))
      ->capture_default_str();
  cmd->add_option("--top-k", a.top_k, "Sample among the k likeliest bytes (0: all)")
      ->check(integer(0, 256))
      ->capture_default_str();
  cmd->add_option("--seed", a.seed, "Seed of the sampling")
      ->check(integer(0, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
}

void write_model_card(const std::string& dir, const nlohmann::json& card) {
  std::filesystem::create_directories(dir);
  write_file_atomically((std::filesystem::path(dir) / "model.json").string(), card.dump(2) + "\n");
}

int run_generate(const GenerateArgs& a) {
  const auto card_path = std::filesystem::path(a.resume) / "model.json";
  TORCH_CHECK(std::filesystem::exists(card_path), "no model.json in ", a.resume,
              ": give the folder that `memfit train --model gpt --save DIR` wrote");
  nlohmann::json card;
  {
    std::ifstream in(card_path);
    std::stringstream text;
    text << in.rdbuf();
    try {
      card = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, card_path.string(), " is not JSON: ", e.what());
    }
  }
  TORCH_CHECK(card.value("model", "") == "gpt", "memfit generate samples text from a GPT; ", a.resume,
              " holds a '", card.value("model", "?"), "' model");
  TextCorpus corpus;
  for (int byte : card.at("vocab")) corpus.vocab.push_back(static_cast<char>(byte));
  const auto options = ModelOptions()
                           .num_classes(corpus.vocab_size())
                           .width(card.at("width").get<int64_t>())
                           .depth(card.at("depth").get<int64_t>())
                           .heads(card.at("heads").get<int64_t>())
                           .context(card.at("context").get<int64_t>());
  // As train built it: the chain inside a CheckpointedSequential.
  CheckpointedSequential checkpointed(make_gpt(options));
  torch::nn::Sequential model(checkpointed);
  load_trainer_model(*model, a.resume);
  model->eval();
  torch::NoGradGuard no_grad;
  auto ids = corpus.encode(a.prompt);
  TORCH_CHECK(ids.numel() > 0, "the prompt is empty: give some text to continue");
  auto generator = at::make_generator<at::CPUGeneratorImpl>(a.seed);
  std::string out = a.prompt;
  for (int64_t i = 0; i < a.tokens; ++i) {
    const int64_t n = ids.numel();
    auto window = ids.narrow(0, std::max<int64_t>(0, n - options.context()), std::min(n, options.context()));
    auto logits = model->forward(window.unsqueeze(0))[0][-1].to(torch::kFloat);
    int64_t next = 0;
    if (a.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / a.temperature;
      if (a.top_k > 0 && a.top_k < logits.numel()) {
        const auto kth = std::get<0>(logits.topk(a.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, 0), 1, false, generator).item<int64_t>();
    }
    ids = torch::cat({ids, torch::tensor({next}, torch::kInt64)});
    out.push_back(corpus.vocab[static_cast<size_t>(next)]);
  }
  fmt::print("{}\n", out);
  return 0;
}

} // namespace memfit::tools
