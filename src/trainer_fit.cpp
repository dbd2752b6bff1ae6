#include "memfit/trainer.h"

#include "trainer_internal.h"

#include "memfit/checkpoint.h"
#include "memfit/schedule.h"

#include "compat.h"
#include "memfit/freeze.h"
#include "memfit/optim.h"
#include "memfit/state.h"
#include "memory_internal.h"
#include "read_ahead.h"
#include "step_components.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>

namespace memfit {

using detail::Clock;
using detail::kCheckpointFile;
using detail::seconds_since;

TrainReport Trainer::fit(const ImageDataset& data, const StepCallback& on_step) {
  TORCH_CHECK(loss_.type() == typeid(std::function<torch::Tensor(const torch::data::Example<>&)>),
              "Trainer::fit cuts torch::data::Example<> batches from an ImageDataset, but the Trainer's loss takes ",
              c10::demangle(loss_.type().name()), ": call train_step in a loop of your own");
  const auto* loss = loss_for<torch::data::Example<>>();
  return run_fit(
      data.size(),
      [&data](const std::vector<size_t>& indices, bool pin) -> std::shared_ptr<void> {
        UntrackedGuard host;  // the batch lives on the host until staged
        const auto idx = torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()));
        torch::data::Example<> batch(data.images.index_select(0, idx), data.labels.index_select(0, idx));
        return std::make_shared<torch::data::Example<>>(pin ? pinned(batch) : std::move(batch));
      },
      [this, loss](const std::shared_ptr<void>& batch) {
        return input_of(*static_cast<const torch::data::Example<>*>(batch.get()), loss);
      },
      on_step);
}

namespace {
// Draws a new epoch's order from `generator` when `order` is used up (or
// none is drawn yet); true when it did.
bool next_epoch(torch::Tensor& order, int64_t& cursor, int64_t n, at::Generator& generator) {
  if (order.defined() && cursor < n) return false;
  UntrackedGuard host;  // the sampler's indices live on the host
  order = torch::randperm(n, generator, torch::kInt64);
  cursor = 0;
  return true;
}

// Batches read ahead of the steps (TrainerOptions::prefetch_factor): the
// sampler's walk repeated from the run's position with a copy of its
// generator, so that the position itself moves only with the steps taken.
class ReadAheadWalk {
 public:
  // `depth` 0: nothing is read ahead.
  ReadAheadWalk(int64_t depth, torch::Tensor order, int64_t cursor, int64_t step, const at::Generator& generator)
      : order_(std::move(order)), cursor_(cursor), step_(step) {
    if (depth <= 0) return;
    ahead_ = std::make_unique<detail::ReadAhead>(static_cast<size_t>(depth));
    generator_ = generator.clone();
  }
  bool active() const { return ahead_ != nullptr; }
  // Queues reads of the next batches of `n` examples, up to step `total`,
  // while there is room: `share` gives a step's indices as Trainer::share_of
  // does, `read` reads them (pinned where `pin`); `read` outlives this walk.
  template <class Share, class Read>
  void fill(int64_t total, int64_t n, const Share& share, const Read& read, bool pin) {
    while (ahead_ && step_ < total && ahead_->has_room()) {
      next_epoch(order_, cursor_, n, generator_);
      int64_t global = 0;
      auto indices = share(order_, cursor_, global);
      cursor_ += global;
      ++step_;
      ahead_->push(indices, [&read, indices, pin] { return read(indices, pin); });
    }
  }
  // The batch of `indices`, read ahead.
  std::shared_ptr<void> pop(const std::vector<size_t>& indices) { return ahead_->pop(indices); }

 private:
  std::unique_ptr<detail::ReadAhead> ahead_;
  torch::Tensor order_;
  int64_t cursor_ = 0, step_ = 0;
  at::Generator generator_;
};

// The run's figures from its steps: time and throughput (saves excluded),
// the last loss, and the peak (on CUDA each step's meter resets the device's
// one peak statistic, so the run's is also taken as the largest step's).
void finish_figures(TrainReport& report, double seconds, int64_t samples, int64_t run_peak) {
  report.seconds = seconds;
  report.samples_per_second = seconds > 0 ? double(samples) / seconds : 0.0;
  report.final_loss = report.steps.empty() ? 0.0 : report.steps.back().loss;
  report.peak_bytes = run_peak;
  for (const auto& r : report.steps) report.peak_bytes = std::max(report.peak_bytes, r.peak_bytes);
}
} // namespace

std::vector<size_t> Trainer::share_of(const torch::Tensor& order, int64_t cursor, int64_t& global) const {
  UntrackedGuard host;
  // The step's examples: `global` from the permutation (the last batch of an
  // epoch holds what is left, like drop_last=false); with data parallelism
  // this rank takes every world-th of them.
  const int64_t n = order.size(0);
  const int64_t world = data_ranks();
  global = std::min(options_.batch_size() * world, n - cursor);
  auto mine = order.narrow(0, cursor, global);
  if (world > 1) mine = mine.slice(0, rank(), global, world);
  mine = mine.contiguous();
  const int64_t* p = mine.data_ptr<int64_t>();
  return std::vector<size_t>(p, p + mine.numel());
}

namespace {

// What every rank must share, as (setting, value) lines: the model's tensors
// first, then the options.
std::string rank_settings(const torch::nn::Module& model, const TrainerOptions& o) {
  std::vector<std::pair<std::string, std::string>> s;
  const auto describe = [](const torch::Tensor& t) {
    std::ostringstream os;
    os << t.sizes() << " " << t.scalar_type();
    return os.str();
  };
  const auto params = model.named_parameters(/*recurse=*/true);
  const auto buffers = model.named_buffers(/*recurse=*/true);
  s.emplace_back("model's number of tensors", fmt::format("{} parameters and {} buffers", params.size(), buffers.size()));
  int64_t i = 0;
  for (const auto& p : params) {
    s.emplace_back(fmt::format("model tensor {}", i++),
                   fmt::format("'{}' {}{}", p.key(), describe(p.value()), p.value().requires_grad() ? "" : " frozen"));
  }
  for (const auto& b : buffers) s.emplace_back(fmt::format("model tensor {}", i++), fmt::format("'{}' {}", b.key(), describe(b.value())));
  const auto name = [](auto value, std::initializer_list<const char*> names) {
    const auto k = static_cast<size_t>(value);
    return k < names.size() ? std::string(names.begin()[k]) : std::to_string(k);
  };
  const char* const offload_names[] = {"kNone", "kHost"};
  const auto offload = [&](Offload v) { return static_cast<size_t>(v) < 2 ? offload_names[static_cast<size_t>(v)] : "?"; };
  s.emplace_back("TrainerOptions::batch_size", std::to_string(o.batch_size()));
  s.emplace_back("TrainerOptions::steps", std::to_string(o.steps()));
  s.emplace_back("TrainerOptions::epochs", std::to_string(o.epochs()));
  s.emplace_back("TrainerOptions::optimizer", o.optimizer_factory() ? "optimizer_factory" : name(o.optimizer(), {"kSGD", "kAdam", "kAdamW"}));
  s.emplace_back("TrainerOptions::lr", fmt::format("{}", o.lr()));
  s.emplace_back("TrainerOptions::momentum", fmt::format("{}", o.momentum()));
  s.emplace_back("TrainerOptions::weight_decay", fmt::format("{}", o.weight_decay()));
  s.emplace_back("TrainerOptions::seed", std::to_string(o.seed()));
  s.emplace_back("TrainerOptions::device", o.device().is_cuda() ? "a CUDA device" : o.device().str());
  s.emplace_back("TrainerOptions::precision", to_string(o.precision()));
  s.emplace_back("TrainerOptions::master_weights", name(o.master_weights(), {"kNone", "kHost", "kDevice"}));
  s.emplace_back("TrainerOptions::max_grad_norm", fmt::format("{}", o.max_grad_norm()));
  s.emplace_back("TrainerOptions::nonfinite_loss", name(o.nonfinite_loss(), {"kError", "kSkip", "kUnchecked"}));
  s.emplace_back("TrainerOptions::micro_batch_size", std::to_string(o.micro_batch_size()));
  s.emplace_back("TrainerOptions::freeze", c10::Join(", ", o.freeze()));
  s.emplace_back("TrainerOptions::offload_optimizer", offload(o.offload_optimizer()));
  s.emplace_back("TrainerOptions::offload_gradients", offload(o.offload_gradients()));
  s.emplace_back("TrainerOptions::offload_parameters", offload(o.offload_parameters()));
  s.emplace_back("TrainerOptions::zero_stage", std::to_string(o.zero_stage()));
  s.emplace_back("TrainerOptions::parallel", name(o.parallel(), {"kData", "kPipeline"}));
  s.emplace_back("TrainerOptions::on_out_of_memory", name(o.on_out_of_memory(), {"kThrow", "kReplan"}));
  s.emplace_back("TrainerOptions::max_replans", std::to_string(o.max_replans()));
  s.emplace_back("TrainerOptions::bucket_cap_mb", fmt::format("{}", o.bucket_cap_mb()));
  std::string text;
  for (const auto& [key, value] : s) text += key + "\t" + value + "\n";
  return text;
}

std::vector<std::pair<std::string, std::string>> setting_lines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    const auto tab = line.find('\t');
    out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
  }
  return out;
}

} // namespace

void check_ranks_agree(const torch::nn::Module& model, const TrainerOptions& options) {
  const auto& group = options.process_group();
  if (group == nullptr || group->size() < 2) return;
  const std::string mine = rank_settings(model, options);
  const std::string first = detail::broadcast_text(*group, mine, 0);
  // The lowest rank that differs from rank 0 speaks for all.
  int64_t lowest = 0;
  {
    UntrackedGuard host;
    auto flag = torch::tensor({mine == first ? int64_t{0} : group->size() - group->rank()}, torch::kLong);
    group->all_reduce_max_(flag);
    lowest = flag.item<int64_t>() == 0 ? -1 : group->size() - flag.item<int64_t>();
  }
  if (lowest < 0) return;
  const auto theirs = setting_lines(detail::broadcast_text(*group, mine, lowest));
  const auto ours = setting_lines(first);
  for (size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    const auto& a = i < ours.size() ? ours[i] : std::pair<std::string, std::string>{"", "nothing"};
    const auto& b = i < theirs.size() ? theirs[i] : std::pair<std::string, std::string>{"", "nothing"};
    if (a == b) continue;
    const std::string what = a.first == b.first ? a.first : a.first.empty() ? b.first : a.first;
    TORCH_CHECK(false, "the ranks disagree before the first step: rank ", lowest, "'s ", what, " is ",
                a.first == b.first ? b.second : b.first + " " + b.second, ", rank 0's is ",
                a.first == b.first ? a.second : a.first + " " + a.second,
                ": start every rank with the same model and options");
  }
  TORCH_INTERNAL_ASSERT(false, "ranks 0 and ", lowest, " differ, in no setting");
}

// A run's saves replace only its own checkpoint: the one it resumed from or wrote.
void Trainer::check_save_dir_is_ours() const {
  if (options_.save_dir().empty() || rank() != 0) return;
  const auto file = std::filesystem::path(options_.save_dir()) / kCheckpointFile;
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return;
  TORCH_CHECK(!continues_.empty() && std::filesystem::equivalent(file, continues_, ec), "TrainerOptions::save_dir ",
              options_.save_dir(), " holds another run's ", kCheckpointFile, ", which this run's saves would replace: "
              "continue that run with Trainer::resume(\"", options_.save_dir(), "\"), or save to another folder");
}

// The run's loop, whole (about 95 lines): the order of its parts is the
// contract (position taken, batches read ahead, the step, the position put
// back when it throws, the record, saves, the stop request), kept in view.
TrainReport Trainer::run_fit(int64_t n, const BatchReader& read, const BatchView& view, const StepCallback& on_step) {
  TORCH_CHECK(n > 0, "Trainer::fit needs a non-empty data set");
  TORCH_CHECK(options_.nonfinite_loss() != NonfiniteLoss::kUnchecked,
              "Trainer::fit reports every step's loss, but nonfinite_loss kUnchecked leaves it unread: use "
              "NonfiniteLoss::kError or kSkip, or call train_step in a loop of your own");
  check_save_dir_is_ours();
  const int64_t total = total_steps_of(n);
  if (step_ >= total) {  // a finished run: start a new one (the generator goes on)
    step_ = 0;
    epoch_ = -1;
    order_ = torch::Tensor();
    cursor_ = 0;
  }
  TORCH_CHECK(!order_.defined() || order_.size(0) == n, "the run's data position is for ",
              order_.defined() ? order_.size(0) : 0, " examples, but the data set has ", n,
              ": resume with the data the run was saved with");
  TrainReport report;
  const size_t recoveries_before = recoveries_.size();
  report.steps.reserve(static_cast<size_t>(std::min<int64_t>(total - step_, 4096)));  // grows with the steps taken
  PeakMeter run_meter(options_.device());
  module_->train();
  const auto run_start = Clock::now();
  int64_t samples = 0;
  double save_seconds = 0;
  int64_t last_saved = -1;
  ReadAheadWalk ahead(options_.prefetch_factor(), order_, cursor_, step_, generator_);
  const auto read_ahead = [&] {
    const auto share = [this](const torch::Tensor& o, int64_t c, int64_t& g) { return share_of(o, c, g); };
    ahead.fill(total, n, share, read, options_.device().is_cuda());
  };
  while (step_ < total) {
    // The run's position before the step: a step that throws leaves it so.
    const torch::Tensor order_before = order_;
    const int64_t cursor_before = cursor_, epoch_before = epoch_;
    const at::Generator generator_before = !order_.defined() || cursor_ >= n ? generator_.clone() : at::Generator();
    if (next_epoch(order_, cursor_, n, generator_)) ++epoch_;
    int64_t global = 0;
    const auto indices = share_of(order_, cursor_, global);
    read_ahead();
    const std::shared_ptr<void> batch = ahead.active() ? ahead.pop(indices) : read(indices, false);
    read_ahead();  // the next batches are read while this step runs
    detail::StepInput in = view(batch);
    in.global_examples = global;
    StepRecord rec;
    try {
      rec = run_step(in);
    } catch (const std::exception& e) {
      order_ = order_before;
      cursor_ = cursor_before;
      epoch_ = epoch_before;
      if (generator_before.defined()) generator_ = generator_before;
      // The step left the state as it found it: a run that gives up keeps it.
      if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr && !options_.save_dir().empty() &&
          options_.on_out_of_memory() == OnOutOfMemory::kReplan) {
        save(options_.save_dir());
      }
      throw;
    }
    for (size_t i = report.recoveries.size() + recoveries_before; i < recoveries_.size(); ++i) {
      report.recoveries.push_back(recoveries_[i]);
    }
    report.skipped_steps += rec.skipped ? 1 : 0;
    if (!timeline_->skipped() && rec.peak_bytes > report.step_memory.peak) {
      report.step_memory = breakdown(rec.peak_bytes, timeline_->model_grad_bytes());
      report.step_timeline = timeline_->timeline();
      for (auto& m : report.step_timeline) m.parameters = report.step_memory.parameters;
    }
    // The step is done: the position moves on.
    cursor_ += global;
    samples += global;
    report.steps.push_back(rec);
    if (!options_.save_dir().empty() && options_.save_every() > 0 &&
        step_ % options_.save_every() == 0) {
      const auto save_start = Clock::now();
      save(options_.save_dir());
      save_seconds += seconds_since(save_start);
      last_saved = step_;
    }
    if (on_step) on_step(rec);
    if (stop_->exchange(false)) {  // request_stop: end here, as at the last step
      report.stopped = true;
      break;
    }
  }
  stop_->store(false);
  if (!options_.save_dir().empty() && last_saved != step_) {
    const auto save_start = Clock::now();
    save(options_.save_dir());
    save_seconds += seconds_since(save_start);
  }
  finish_figures(report, seconds_since(run_start) - save_seconds, samples, run_meter.peak());
  report.precision = to_string(options_.precision());
  if (state_optimizer() != nullptr) report.optimizer_kernel = optim::kernel_ran(*state_optimizer());
  report.final_scale = scaler_->is_enabled() ? scaler_->get_scale() : 0.0;
  return report;
}

EvalResult Trainer::evaluate(const ImageDataset& data) {
  TORCH_CHECK(data.size() > 0, "Trainer::evaluate needs a non-empty data set");
  TORCH_CHECK(classifier_, "Trainer::evaluate measures the cross-entropy classifier that a Trainer built from "
              "a torch::nn::Sequential without a loss trains: for your own module and loss, call eval_step "
              "with your metric");
  const auto device = options_.device();
  torch::NoGradGuard no_grad;
  PeakMeter meter(device);
  module_->eval();
  struct TrainModeAgain {  // also when a chunk throws
    torch::nn::Module& m;
    ~TrainModeAgain() { m.train(); }
  } train_again{*module_};
  const int64_t n = data.size();
  double loss_sum = 0;
  int64_t correct = 0;
  // Evaluating changes nothing: with kReplan a chunk that runs out of memory
  // is read again in halves, and the rest in chunks that size.
  const int64_t chunk = detail::read_in_parts(
      n, options_.eval_batch_size(), options_.on_out_of_memory() == OnOutOfMemory::kReplan, device,
      [&](int64_t start, int64_t length) {
        auto x = data.images.narrow(0, start, length).to(device);
        auto y = data.labels.narrow(0, start, length).to(device);
        torch::Tensor logits;
        {
          AutocastGuard autocast(device, options_.precision());
          logits = pipeline_ ? pipeline_->forward(x) : stream_ ? stream_->forward(x) : classifier_->forward(x);
        }
        if (!logits.defined()) return;  // a pipeline's output is on its last stage
        const double chunk_loss = detail::cross_entropy(logits, y, /*sum=*/true).item<double>();
        const int64_t chunk_correct = logits.argmax(-1).eq(y).sum().item<int64_t>();
        loss_sum += chunk_loss;  // only once the chunk is read whole
        correct += chunk_correct;
      });
  if (pipeline_) {  // the last stage's sums, everywhere
    UntrackedGuard host;
    auto sums = torch::tensor({loss_sum, double(correct)}, torch::kDouble);
    options_.process_group()->broadcast_(sums, world_size() - 1);
    loss_sum = sums[0].item<double>();
    correct = static_cast<int64_t>(sums[1].item<double>());
  }
  EvalResult r;
  const double labels = double(data.labels.numel());  // a label per example, or per token
  r.loss = loss_sum / labels;
  r.accuracy = double(correct) / labels;
  r.peak_bytes = meter.peak();
  r.batch_size = chunk;
  return r;
}

std::string TrainReport::to_json() const {
  nlohmann::json j;
  j["steps"] = nlohmann::json::array();
  for (const auto& s : steps) {
    j["steps"].push_back({{"step", s.step},
                          {"epoch", s.epoch},
                          {"loss", s.loss},
                          {"seconds", s.seconds},
                          {"peak_bytes", s.peak_bytes},
                          {"current_bytes", s.current_bytes},
                          {"skipped", s.skipped},
                          {"replans", s.replans}});
  }
  j["recoveries"] = nlohmann::json::array();
  for (const auto& r : recoveries) {
    j["recoveries"].push_back({{"step", r.step},
                               {"what", r.what},
                               {"peak_bytes", r.peak_bytes},
                               {"limit_bytes", r.limit_bytes},
                               {"before", r.before},
                               {"after", r.after},
                               {"seconds", r.seconds}});
  }
  j["step_timeline"] = nlohmann::json::array();
  for (const auto& m : step_timeline) {
    const int64_t persistent = m.parameters;
    j["step_timeline"].push_back(
        {{"phase", m.phase},
         {"peak_bytes", m.peak_bytes},
         {"current_bytes", m.current_bytes},
         {"parameters", persistent},
         {"gradients", m.gradients},
         {"optimizer_state", m.optimizer_state},
         {"activations",
          std::max<int64_t>(0, m.peak_bytes - persistent - m.gradients - m.optimizer_state)}});
  }
  nlohmann::json summary = {{"steps", steps.size()},
                            {"final_loss", final_loss},
                            {"seconds", seconds},
                            {"samples_per_second", samples_per_second},
                            {"peak_bytes", peak_bytes},
                            {"precision", precision},
                            {"optimizer_kernel", optimizer_kernel},
                            {"skipped_steps", skipped_steps},
                            {"recoveries", recoveries.size()},
                            {"stopped", stopped},
                            {"final_scale", final_scale},
                            {"step_memory", nlohmann::json::parse(step_memory.to_json())}};
  if (evaluated) {
    summary["test_accuracy"] = test.accuracy;
    summary["test_loss"] = test.loss;
    summary["eval_peak_bytes"] = test.peak_bytes;
  }
  j["summary"] = summary;
  return j.dump(2);
}

} // namespace memfit
