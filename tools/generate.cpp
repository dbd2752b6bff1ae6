#include "generate.h"
#include "usage.h"

#include "memfit/data.h"
#include "memfit/models.h"
#include "memfit/checkpoint.h"
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

// Reads and checks what `memfit train --save` wrote to model.json: anything
// missing, of another type or out of range is a usage error naming the field.
struct ModelCard {
  ModelOptions options;
  TextCorpus corpus;
};

ModelCard read_model_card(const std::string& dir) {
  const auto path = (std::filesystem::path(dir) / "model.json").string();
  usage_check(std::filesystem::is_regular_file(path), "--resume ", dir,
              ": no model.json there; give the folder that `memfit train --model gpt --save DIR` wrote");
  nlohmann::json card;
  {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    try {
      card = nlohmann::json::parse(text.str(), nullptr, true, false);
    } catch (const nlohmann::json::parse_error& e) {
      usage_check(false, path, " is damaged: not JSON at byte ", e.byte,
                  "; save the run again with `memfit train --save`");
    }
  }
  usage_check(card.is_object(), path, " is damaged: not a JSON object");
  const auto text_of = [&](const char* key) {
    return card.contains(key) && card[key].is_string() ? card[key].get<std::string>() : std::string("?");
  };
  usage_check(text_of("model") == "gpt", "memfit generate samples text from a GPT; ", dir, " holds a '",
              text_of("model"), "' model: give the folder of a `memfit train --model gpt --save DIR` run");
  const auto integer = [&](const char* key, int64_t lo, int64_t hi) {
    usage_check(card.contains(key) && card[key].is_number_integer(), path, " is damaged: \"", key,
                "\" is missing or not an integer");
    const auto v = card[key].get<int64_t>();
    usage_check(v >= lo && v <= hi, path, " is damaged: \"", key, "\" is ", v, ", not in [", lo, ", ", hi, "]");
    return v;
  };
  ModelCard out;
  usage_check(card.contains("vocab") && card["vocab"].is_array() && !card["vocab"].empty() &&
                  card["vocab"].size() <= 256,
              path, " is damaged: \"vocab\" is not a list of 1 to 256 bytes");
  for (const auto& byte : card["vocab"]) {
    usage_check(byte.is_number_integer() && byte.get<int64_t>() >= 0 && byte.get<int64_t>() <= 255, path,
                " is damaged: \"vocab\" holds ", byte.dump(), ", not a byte (0 to 255)");
    out.corpus.vocab.push_back(static_cast<char>(byte.get<int>()));
  }
  out.options = ModelOptions()
                    .num_classes(out.corpus.vocab_size())
                    .width(integer("width", 1, 65536))
                    .depth(integer("depth", 1, 4096))
                    .heads(integer("heads", 1, 4096))
                    .context(integer("context", 1, 65536));
  return out;
}

int run_generate(const GenerateArgs& a) {
  auto [options, corpus] = read_model_card(a.resume);
  usage_check(!a.prompt.empty(), "--prompt is empty: give some text to continue");
  auto ids = as_usage([&] { return corpus.encode(a.prompt); });
  // As train built it: the chain inside a CheckpointedSequential.
  CheckpointedSequential checkpointed(make_gpt(options));
  torch::nn::Sequential model(checkpointed);
  as_usage([&] { load_trainer_model(*model, a.resume); });  // another model's checkpoint: a usage error
  model->eval();
  torch::NoGradGuard no_grad;
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
