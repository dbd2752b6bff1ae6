#include "usage.h"

#include "memfit/memory.h"
#include "memfit/plan.h"
#include "memfit/state.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>

#include <unistd.h>

namespace memfit::tools {

CLI::Validator integer(int64_t lo, int64_t hi) {
  const std::string range = lo == 1 && hi == std::numeric_limits<int64_t>::max() ? "a positive integer"
                            : lo == 1 ? fmt::format("a positive integer of at most {}", hi)
                            : lo == 0 ? fmt::format("an integer from 0 to {}", hi)
                                      : fmt::format("an integer from {} to {}", lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        int64_t v = 0;
        const char* end = text.data() + text.size();
        const auto [p, ec] = std::from_chars(text.data(), end, v);
        if (ec != std::errc() || p != end || v < lo || v > hi) {
          return fmt::format("must be {}, got {}", range, text.size() > 40 ? text.substr(0, 40) + "..." : text);
        }
        return {};
      },
      "INT");
}

CLI::Validator real(double lo, double hi, bool open_lo) {
  const std::string range = fmt::format("a number in {}{:g}, {:g}]", open_lo ? "(" : "[", lo, hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || v > hi ||
            (open_lo ? v <= lo : v < lo)) {
          return fmt::format("must be {}, got {}", range, text.size() > 40 ? text.substr(0, 40) + "..." : text);
        }
        return {};
      },
      "NUMBER");
}

CLI::Validator path(const std::string& what) {
  return CLI::Validator(
      [what](std::string& text) -> std::string {
        return text.empty() ? "must name a " + what + ", got an empty string" : std::string();
      },
      what == "folder" ? "DIR" : "FILE");
}

CLI::Validator memory_size() {
  return parsed_by(
      [](const std::string& text) {
        TORCH_CHECK(memfit::parse_memory_size(text) > 0, "must be positive, e.g. 64MiB, got ", text);
      },
      "SIZE");
}

CLI::Validator parsed_by(std::function<void(const std::string&)> parse, const std::string& name) {
  return CLI::Validator(
      [parse = std::move(parse)](std::string& text) -> std::string {
        try {
          parse(text);
          return {};
        } catch (const c10::Error& e) {
          return e.msg();
        }
      },
      name);
}

std::string plain_parse_error(const std::string& what) {
  const auto colon = what.find(": must ");
  if (what.rfind("--", 0) == 0 && colon != std::string::npos && what.find(' ') > colon) {
    return what.substr(0, colon) + what.substr(colon + 1);
  }
  return what;
}

std::string with_flag_names(std::string message) {
  static const std::pair<const char*, const char*> names[] = {
      {"TrainerOptions::batch_size", "--batch"},
      {"TrainerOptions::save_dir", "--save"},
      {"TrainerOptions::steps", "--steps"},
      {"TrainerOptions::epochs", "--epochs"},
      {"TrainerOptions::lr", "--lr"},
      {"TrainerOptions::seed", "--seed"},
      {"TrainerOptions::optimizer ", "--optimizer "},
      {"TrainerOptions::zero_stage", "--zero-stage"},
      {"TrainerOptions::freeze", "--freeze"},
      {"TrainerOptions::parallel", "--parallel"},
      {"TrainerOptions::on_out_of_memory", "--on-out-of-memory"},
      {"TrainerOptions::precision", "--precision"},
      {"TrainerOptions::micro_batch_size", "--micro-batch"},
      {"TrainerOptions::offload_parameters", "--offload parameters"},
      {"TrainerOptions::offload_optimizer and offload_gradients", "--offload optimizer,gradients"},
      {"TrainerOptions::process_group", "memfit launch"},
      {"WorldInfo::master_port, MASTER_PORT", "memfit launch --master-port, or MASTER_PORT"},
      {"PlanOptions::precisions({kFP32, kBF16})", "--precision any"},
      {"PlanOptions::precisions", "--precision"},
      {"PlanOptions::selective_recompute", "--selective-recompute"},
      {"PlanOptions::batch_statistics(kPerMicroBatch)", "--batch-statistics per-micro-batch"},
      {"PlanOptions::batch_statistics", "--batch-statistics"},
      {"PlanOptions::profile_budget", "the budget (--budget)"},
      {"NonfiniteLoss::kSkip", "--skip-nonfinite"},
      {"TrainerOptions::max_grad_norm", "--clip-grad-norm"},
      {"load_plan: ", ""},
      {"with save_plan", "with `memfit plan --save`"},
      {"that save_plan wrote", "that `memfit plan --save` wrote"},
  };
  // The planner's margin has no flag: the CLI keeps PlanOptions' default.
  static const std::string margin = fmt::format("the planner's {:g}% margin", 100 * memfit::PlanOptions().margin());
  for (const auto& [cpp, flag] : names) {
    for (auto at = message.find(cpp); at != std::string::npos; at = message.find(cpp, at)) {
      message.replace(at, std::string(cpp).size(), flag);
    }
  }
  for (auto at = message.find("PlanOptions::margin"); at != std::string::npos; at = message.find("PlanOptions::margin", at)) {
    message.replace(at, std::string("PlanOptions::margin").size(), margin);
  }
  return message;
}

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec)) return true;  // both exist: links and all
  const auto ca = std::filesystem::weakly_canonical(a, ec);
  if (ec) return false;
  const auto cb = std::filesystem::weakly_canonical(b, ec);
  return !ec && ca == cb;  // one to be written: the same resolved path
}

void check_output(const std::string& flag, const std::string& output, const std::vector<std::string>& inputs) {
  as_usage([&] { memfit::check_output_file(output); });
  for (const auto& input : inputs) {
    usage_check(!same_file(output, input), flag, " ", output, " is also an input of this command (", input,
                "): write to another file");
  }
}

void check_outputs_apart(const std::string& flag, const std::string& output, const std::string& other_flag,
                         const std::vector<std::string>& others) {
  for (const auto& other : others) {
    usage_check(!same_file(output, other), flag, " ", output, " is also where ", other_flag, " writes (", other,
                "): give them different paths");
  }
}

int64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long size = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<int64_t>(pages) * size : std::numeric_limits<int64_t>::max();
}

} // namespace memfit::tools
