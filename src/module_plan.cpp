#include "memfit/module_plan.h"

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/profile.h"
#include "memfit/state.h"
#include "plan_choice.h"
#include "plan_model.h"
#include "plan_report.h"
#include "plan_wire.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace memfit {
ModulePlan plan(const ModuleStepModel& model, int64_t budget) { return plan(model, budget, model.sample_examples()); }

ModulePlan plan(const ModuleStepModel& model, int64_t budget, int64_t batch) {
  TORCH_CHECK(budget > 0, "plan: budget must be positive, got ", budget);
  TORCH_CHECK(batch >= 4 && batch <= model.sample_examples(), "plan: batch ", batch, " is not one the measured "
              "sample holds: plan batches of 4 to ", model.sample_examples(), " examples, or measure a larger sample");
  auto& im = *model.impl_;  // a cache: measuring held-back settings leaves the model logically const
  const Decision d = decide(model, im, budget, batch);
  TORCH_CHECK(d.chosen >= 0, nothing_fits_text(im, d));
  ModulePlan out;
  out.budget = budget;
  out.batch = batch;
  out.model = model_signature(*im.probe.module);
  out.optimizer = optimizer_signature(im.base);
  out.chains = im.chain_names();
  out.plain_peak_bytes = d.plain.peak_bytes;
  out.plain_seconds = d.plain.seconds;
  out.candidates = d.considered;
  for (const auto& r : d.rounds) {
    for (size_t k = 0; k < r.order.size(); ++k) {
      const auto& c = d.candidates[r.order[k]];
      const auto& t = r.measured.timed[k];
      out.timed.push_back({c.settings, c.schedules, c.predicted.seconds, t.seconds, std::max<int64_t>(t.peak_bytes, 0)});
    }
  }
  out.measured_seconds = d.measured_seconds;
  out.step_seconds = d.step_seconds;
  out.measured_peak_bytes = d.measured_peak_bytes;
  out.measured_tie = d.measured_tie;
  const auto& best = d.candidates[static_cast<size_t>(d.chosen)];
  out.fits = true;
  out.settings = best.settings;
  out.schedules = best.schedules;
  out.predicted = best.predicted;
  out.why = plan_why(im, d);
  return out;
}

namespace {
// Sets each of `chains`' schedules in `module`, found by name (`who` names the caller).
void set_schedules(torch::nn::Module& module, const std::vector<std::string>& chains,
                   const std::vector<Schedule>& schedules, const char* who) {
  auto found = find_chains(module);
  TORCH_CHECK(found.size() == chains.size(), who, ": the plan has ", chains.size(),
              " chain(s) but the module has ", found.size(), "; apply a plan to the module it was made for");
  for (size_t c = 0; c < found.size(); ++c) {
    TORCH_CHECK(found[c].name == chains[c], who, ": the plan's chain '", chains[c],
                "' is not in the module (found '", found[c].name, "')");
    const auto n = static_cast<int64_t>(found[c].chain->sequential()->size());
    found[c].chain->set_schedule(c < schedules.size() && !schedules[c].segments.empty() ? schedules[c]
                                                                                         : schedule_none(n));
  }
}

std::string checkpoint_json(const std::vector<std::string>& chains, const std::vector<Schedule>& schedules) {
  auto out = nlohmann::json::array();
  for (size_t c = 0; c < chains.size(); ++c) {
    out.push_back({{"name", chains[c]},
                   {"checkpoint", c < schedules.size() && detail::recomputes(schedules[c]) ? schedules[c].to_string()
                                                                                  : std::string("none")}});
  }
  return out.dump();
}
} // namespace

TrainerOptions ModulePlan::apply(torch::nn::Module& module, TrainerOptions base) const {
  set_schedules(module, chains, schedules, "ModulePlan::apply");
  set_selective_recompute(module, settings.selective_recompute());
  return trainer_options(settings, std::move(base));
}

namespace {
// Whether moving from `now` to `next` takes something back to the device,
// which a re-plan does not do (TrainerOptions::restore_after does).
bool moves_back(Offload now, Offload next) { return now == Offload::kHost && next != Offload::kHost; }

// The failed attempt's settings as the step model names them: the event's
// micro-batch and placements, with `precision` and `selective`.
StepSettings settings_of(const OutOfMemoryEvent& e, Precision precision, bool selective) {
  const bool whole = e.micro_batch_size <= 0 || e.micro_batch_size >= e.examples;
  return StepSettings()
      .micro_batch(whole ? 0 : e.micro_batch_size)
      .precision(precision)
      .offload_optimizer(e.offload_optimizer)
      .offload_gradients(e.offload_gradients)
      .offload_parameters(e.offload_parameters)
      .tile_bytes(e.offload_parameters == Offload::kHost ? e.stream.tile_bytes() : 0)
      .selective_recompute(selective);
}

// Whether the Trainer of event `e`, now at `now`, may retry with `next`:
// the same math (precision, selective recomputation, and the micro-batch
// where the module may not be split), nothing moved back, and each move one
// the Trainer can make.
bool may_take(const StepSettings& now, const StepSettings& next, const OutOfMemoryEvent& e, bool may_split) {
  if (next.precision() != now.precision() || next.selective_recompute() != now.selective_recompute()) return false;
  if (!may_split && next.micro_batch() != now.micro_batch()) return false;
  if (moves_back(now.offload_optimizer(), next.offload_optimizer()) ||
      moves_back(now.offload_gradients(), next.offload_gradients()) ||
      moves_back(now.offload_parameters(), next.offload_parameters())) {
    return false;
  }
  const bool moves = next.offload_optimizer() != now.offload_optimizer() ||
                     next.offload_gradients() != now.offload_gradients();
  if (moves && !e.may_offload_optimizer) return false;
  return next.offload_parameters() == now.offload_parameters() || e.may_offload_parameters;
}

// The Replan that takes a Trainer of `module` at `now` to candidate `c`.
// Where the module may be split, "the whole batch" becomes micro-batches of
// the event's batch: the same step for it, and no larger for the next one,
// which may be longer (after an epoch's short last batch, a full one).
Replan replan_to(const Candidate& c, const StepSettings& now, const OutOfMemoryEvent& e, bool may_split,
                 std::shared_ptr<torch::nn::Module> module, const std::vector<std::string>& names) {
  Replan r;
  const auto& s = c.settings;
  r.micro_batch_size = s.micro_batch() == 0 && may_split ? e.examples : s.micro_batch();
  if (s.offload_optimizer() != now.offload_optimizer()) r.offload_optimizer = s.offload_optimizer();
  if (s.offload_gradients() != now.offload_gradients()) r.offload_gradients = s.offload_gradients();
  if (s.offload_parameters() != now.offload_parameters()) r.offload_parameters = s.offload_parameters();
  if (s.offload_parameters() == Offload::kHost && s.tile_bytes() != now.tile_bytes()) {
    r.stream = StreamOptions(e.stream).tile_bytes(s.tile_bytes());
  }
  r.apply = [module = std::move(module), names, schedules = c.schedules] {
    set_schedules(*module, names, schedules, "replan_from_model");
  };
  r.description = detail::candidate_text(c, e.examples, names) + " (the step model's choice)";
  return r;
}
} // namespace

OutOfMemoryPolicy replan_from_model(std::shared_ptr<const ModuleStepModel> model, const ModulePlan& plan,
                                    OutOfMemoryPolicy fallback) {
  TORCH_CHECK(model != nullptr, "replan_from_model: the step model is null; pass the model plan() was given");
  const ModuleStepModel::Impl* im = model->impl_.get();
  TORCH_CHECK(plan.chains == im->chain_names() && plan.model == model_signature(*im->probe.module),
              "replan_from_model: the plan was not made for this step model's module (", plan.model,
              "); pass the plan that plan(model, ...) returned");
  const bool may_split = detail::may_micro_batch(im->options, im->batch_statistics);
  if (!fallback) {
    fallback = more_micro_batches(*im->probe.module, im->options.batch_statistics() == BatchStatistics::kPerMicroBatch);
  }
  const Precision precision = plan.settings.precision();
  return [model, im, may_split, precision, fallback](const OutOfMemoryEvent& e) -> std::optional<Replan> {
    const auto now = settings_of(e, precision, selective_recompute(*im->probe.module));
    const auto measured = model->measured_settings();
    const bool known = std::any_of(measured.begin(), measured.end(),
                                   [&](const StepSettings& m) { return detail::same_measurement(m, now); });
    if (!known || e.examples <= 0) return fallback(e);
    std::vector<Schedule> schedules;  // as the chains run now; streamed chains run as measured
    if (now.offload_parameters() != Offload::kHost) {
      for (const auto& c : im->chains) schedules.push_back(c.chain->schedule());
    }
    const int64_t predicted = model->predict(e.examples, now, schedules).peak_bytes;
    const int64_t target = e.limit_bytes > 0 ? std::min(e.limit_bytes, predicted) : predicted;
    const Search found = search(*model, *im, e.examples, target, may_split, 1.0,
                                [&](const StepSettings& s) { return may_take(now, s, e, may_split); });
    const auto limit = static_cast<int64_t>(std::floor(im->options.margin() * double(target)));
    // Edge candidates lie above the limit; untimed predictions tie within kPredictionTie.
    const auto best = best_fitting(found.fitting, 1.0, limit, detail::kPredictionTie);
    if (!best) return fallback(e);
    return replan_to(found.fitting[*best], now, e, may_split, im->probe.module, im->chain_names());
  };
}

namespace {
// Each chain's schedule, "; "-separated ("none" for a plain one, and for no chain).
std::string schedules_only_text(const std::vector<Schedule>& schedules) {
  std::vector<std::string> out;
  for (const auto& s : schedules) out.push_back(detail::recomputes(s) ? s.to_string() : std::string("none"));
  return out.empty() ? std::string("none") : fmt::format("{}", fmt::join(out, "; "));
}
} // namespace

std::string ModulePlan::to_json() const {
  nlohmann::json timed_json = nlohmann::json::array();
  for (const auto& t : timed) {
    timed_json.push_back({{"micro_batch", t.settings.micro_batch() > 0 ? t.settings.micro_batch() : batch},
                          {"precision", to_string(t.settings.precision())},
                          {"offload", offload_text(t.settings)},
                          {"checkpoint", schedules_only_text(t.schedules)},
                          {"predicted_seconds", t.predicted_seconds},
                          {"measured_seconds", t.measured_seconds},
                          {"measured_peak_bytes", t.measured_peak_bytes}});
  }
  nlohmann::json j = {{"fits", fits},
                      {"budget_bytes", budget},
                      {"batch", batch},
                      {"micro_batch", settings.micro_batch() > 0 ? settings.micro_batch() : batch},
                      {"accumulation_steps", predicted.accumulation_steps},
                      {"precision", to_string(settings.precision())},
                      {"checkpoint", detail::checkpoint_text(chains, schedules)},
                      {"chains", nlohmann::json::parse(checkpoint_json(chains, schedules))},
                      {"selective_recompute", settings.selective_recompute()},
                      {"offload", offload_text(settings)},
                      {"tile_bytes", settings.tile_bytes()},
                      {"predicted_peak_bytes", predicted.peak_bytes},
                      {"predicted_seconds", predicted.seconds},
                      {"predicted_phase", predicted.phase},
                      {"plain_peak_bytes", plain_peak_bytes},
                      {"plain_seconds", plain_seconds},
                      {"candidates", candidates},
                      {"measured_seconds", measured_seconds},
                      {"step_seconds", step_seconds},
                      {"measured_peak_bytes", measured_peak_bytes},
                      {"measured_tie", measured_tie},
                      {"timed", timed_json},
                      {"predicted_memory", nlohmann::json::parse(predicted.memory.to_json())},
                      {"why", why}};
  return j.dump(2);
}

std::string ModulePlan::explain() const {
  std::string out = fmt::format("plan for a batch of {} under {}: {}\n", batch, format_bytes(budget),
                                fits ? "fits" : "does not fit");
  for (const auto& line : why) out += "  - " + line + "\n";
  return out;
}

std::string model_signature(const torch::nn::Module& module) {
  std::string shapes;
  int64_t tensors = 0, values = 0;
  const auto add = [&](const torch::Tensor& t) {
    ++tensors;
    values += t.numel();
    shapes += fmt::format("{} {}\n", fmt::join(t.sizes(), "x"), c10::toString(t.scalar_type()));
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) add(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) add(b);
  const auto crc = ::crc32(0, reinterpret_cast<const Bytef*>(shapes.data()), static_cast<uInt>(shapes.size()));
  return fmt::format("{} tensors of {} values, shapes' CRC-32 {:08x}", tensors, values, crc);
}

std::string optimizer_signature(const TrainerOptions& options) {
  if (options.optimizer_factory()) return "optimizer_factory's";
  switch (options.optimizer()) {
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kSGD:
      return options.momentum() != 0 ? "SGD with momentum" : "SGD";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled optimizer kind");
}

namespace {
constexpr const char* kPlanFormat = "memfit.module_plan.v1";
} // namespace

void save_plan(const ModulePlan& plan, const std::string& path) {
  auto wire = detail::plan_wire(plan);
  wire["format"] = kPlanFormat;
  write_file_atomically(path, wire.dump(2) + "\n");
}

namespace {
// A JSON library's exception as a reader's words: "[json.exception.type_error.302] type must be number,
// but is string" becomes "type must be number, but is string".
std::string json_error_text(const nlohmann::json::exception& e) {
  std::string text = e.what();
  const auto close = text.find("] ");
  return text.rfind("[json.exception.", 0) == 0 && close != std::string::npos ? text.substr(close + 2) : text;
}
} // namespace

ModulePlan load_plan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good() && !std::filesystem::is_directory(path), "load_plan: cannot read ", path,
              ": give the file that save_plan wrote");
  ModulePlan plan;
  nlohmann::json wire;
  try {
    wire = detail::parse_json(in);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is not JSON (", json_error_text(e), "): write it again with save_plan");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, " is damaged: ", e.what_without_backtrace(), "; write it again with save_plan");
  }
  TORCH_CHECK(wire.is_object() && wire.contains("format") && wire["format"].is_string() &&
                  wire["format"].get<std::string>() == kPlanFormat,
              path,
              " is not a memfit plan (", kPlanFormat, "): write one with save_plan");
  try {
    detail::plan_from_wire(wire, plan);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is damaged (", json_error_text(e), "): write it again with save_plan");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, " is damaged: ", e.what_without_backtrace(), "; write it again with save_plan");
  }
  return plan;
}

std::string plan_mismatch(const ModulePlan& plan, const torch::nn::Module& module, int64_t batch, int64_t budget,
                          const PlanOptions& options, const TrainerOptions& base) {
  const auto& s = plan.settings;
  if (!plan.model.empty() && plan.model != model_signature(module)) {
    return fmt::format("it was made for another model ({}), not this one ({})", plan.model, model_signature(module));
  }
  if (!plan.optimizer.empty() && plan.optimizer != optimizer_signature(base)) {
    return fmt::format("its steps were measured with the optimizer {}, not {}", plan.optimizer,
                       optimizer_signature(base));
  }
  if (plan.budget != budget) {
    return fmt::format("it was made for a budget of {}, not {}", format_bytes(plan.budget), format_bytes(budget));
  }
  if (plan.batch != batch) return fmt::format("it was made for a batch of {}, not {}", plan.batch, batch);
  const auto& allowed = options.precisions();
  if (std::find(allowed.begin(), allowed.end(), s.precision()) == allowed.end()) {
    return fmt::format("it trains in {}, which PlanOptions::precisions leaves out", to_string(s.precision()));
  }
  if (s.micro_batch() > 0 && s.micro_batch() < batch) {
    const auto layer = batch_statistics_layer(module);
    if (!detail::may_micro_batch(options, layer)) {
      return layer ? fmt::format("it micro-batches, which changes the statistics of BatchNorm layer '{}', and "
                                 "PlanOptions::batch_statistics keeps them", *layer)
                   : std::string("it micro-batches, and PlanOptions::micro_batching is false");
    }
  }
  if (detail::offload_rank(s) > 0 && !options.offload()) return "it offloads, and PlanOptions::offload is false";
  if ((s.selective_recompute() && options.selective_recompute() == SelectiveRecompute::kOff) ||
      (!s.selective_recompute() && options.selective_recompute() == SelectiveRecompute::kOn)) {
    return fmt::format("it {} selective recomputation, which PlanOptions::selective_recompute rules out",
                       s.selective_recompute() ? "uses" : "goes without");
  }
  const auto found = find_chains(module);
  for (size_t i = 0; i < plan.chains.size(); ++i) {
    const auto& name = plan.chains[i];
    if (std::none_of(found.begin(), found.end(), [&](const FoundChain& f) { return f.name == name; })) {
      return fmt::format("it schedules chain '{}', which the module lacks", name);
    }
    if (!options.checkpointing() && detail::recomputes(plan.schedules[i])) {
      return fmt::format("it recomputes in chain '{}', and PlanOptions::checkpointing is false", name);
    }
  }
  return "";
}

ModuleBatchSearch find_batch(const ModuleStepModel& model, int64_t budget, const FindBatchOptions& options) {
  TORCH_CHECK(budget > 0, "find_batch: budget must be positive, got ", budget);
  TORCH_CHECK(options.max_batch() > 0, "FindBatchOptions::max_batch must be positive, got ", options.max_batch());
  TORCH_CHECK(options.attempts() > 0, "FindBatchOptions::attempts must be positive, got ", options.attempts());
  model.impl_->measure_held_back();  // streaming may fit a larger batch
  const auto& im = *model.impl_;
  const auto& o = im.options;
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  // Verified answers are run, so they are at most the examples the probe reads.
  const int64_t top = options.verify() ? std::min(options.max_batch(), im.probe.examples) : options.max_batch();
  ModuleBatchSearch out;
  out.budget = budget;
  for (const auto& f : im.chains) out.chains.push_back(f.name);
  // Each search, then its verification; `choose` gives the step for a batch, if one fits.
  auto run = [&](ModuleBatchFound& found, const std::function<std::optional<Candidate>(int64_t)>& choose) {
    found.batch = detail::largest_fitting(top, [&](int64_t b) { return choose(b).has_value(); });
    while (found.batch > 0) {
      const auto c = *choose(found.batch);
      found.settings = c.settings;
      found.schedules = c.schedules;
      found.predicted_peak_bytes = c.predicted.peak_bytes;
      if (!options.verify() || found.attempts >= options.attempts()) return;
      ++found.attempts;
      const int64_t peak = run_plan(model, im, c, found.batch, budget).peak_bytes;
      if (peak >= 0 && peak <= budget) {
        found.verified = true;
        found.measured_peak_bytes = peak;
        return;
      }
      found.batch = static_cast<int64_t>(double(found.batch) * 0.9);
      while (found.batch > 0 && !choose(found.batch)) --found.batch;
    }
  };
  const auto plain = im.plain_settings();
  run(out.plain, [&](int64_t b) -> std::optional<Candidate> {
    Candidate c{plain, std::vector<Schedule>(im.chains.size()), model.predict(b, plain, {})};
    if (c.predicted.peak_bytes > limit) return std::nullopt;
    return c;
  });
  run(out.techniques, [&](int64_t b) -> std::optional<Candidate> {
    auto found = search(model, im, b, budget, /*micro_batching=*/false);
    const auto best = best_fitting(found.fitting, 1.0, limit);
    if (!best) return std::nullopt;
    return found.fitting[*best];
  });
  return out;
}

namespace detail {
StepProbe make_probe(torch::nn::Sequential model, const torch::data::Example<>& sample) {
  TORCH_CHECK(!model.is_empty(), "plan needs a model, got an empty Sequential holder");
  using Traits = BatchTraits<torch::data::Example<>>;
  StepProbe probe;
  probe.module = model.ptr();
  probe.examples = Traits::size(sample);
  probe.make_trainer = [model](const TrainerOptions& options) { return Trainer(model, options); };
  probe.step = [sample](Trainer& trainer, int64_t examples) {
    return trainer.train_step(Traits::slice(sample, 0, examples));
  };
  return probe;
}
} // namespace detail

ModulePlan plan(torch::nn::Sequential model, const torch::data::Example<>& sample, int64_t budget,
                PlanOptions options, TrainerOptions base) {
  ModuleStepModel m(detail::make_probe(std::move(model), sample), detail::measuring_within(std::move(options), budget),
                    std::move(base));
  return plan(m, budget);
}

ModuleProfile profile(torch::nn::Sequential model, const torch::data::Example<>& sample, PlanOptions options,
                      TrainerOptions base) {
  ModuleStepModel m(detail::make_probe(std::move(model), sample), std::move(options), std::move(base));
  return profile(m);
}

ModuleProfile profile(const ModuleStepModel& model) {
  const auto& im = *model.impl_;
  ModuleProfile out;
  out.batch = im.probe.examples;
  out.precision = im.options.precisions().front();
  const auto plain = im.plain_settings();
  for (size_t c = 0; c < im.chains.size(); ++c) {
    out.chains.push_back(im.chains[c].name);
    const auto& p = im.profiles.at(std::make_pair(out.precision, plain.selective_recompute()))[c];
    out.layers.push_back(scale_profile(p.first, p.second, im.m_small, im.m_large, out.batch));
  }
  out.predicted = model.predict(out.batch, plain, {});
  // Three real steps: the first makes the optimizer's state.
  detail::ModuleStateGuard restore(*im.probe.module);
  SelectiveRecomputeGuard selective(*im.probe.module, plain.selective_recompute());
  auto trainer = im.probe.make_trainer(
      trainer_options(plain, im.base).batch_size(out.batch).save_dir("").on_out_of_memory(OnOutOfMemory::kThrow));
  for (int k = 0; k < 3; ++k) {
    const auto rec = im.probe.step(trainer, out.batch);
    if (k > 0) out.step_seconds = k == 1 ? rec.seconds : std::min(out.step_seconds, rec.seconds);
  }
  out.step = trainer.last_step_memory();
  out.timeline = trainer.last_timeline();
  return out;
}

std::string ModuleProfile::table() const {
  std::string out;
  for (size_t c = 0; c < chains.size(); ++c) {
    out += fmt::format("chain {} at batch {} ({}):\n{}", chains[c].empty() ? "(the module)" : chains[c], batch,
                       to_string(precision), layers[c].table());
  }
  out += fmt::format("predicted plain training step: peak {} in the {} phase, {:.1f} ms\n{}",
                     format_bytes(predicted.peak_bytes), predicted.phase, 1e3 * predicted.seconds,
                     predicted.memory.table());
  out += fmt::format("measured plain training step: peak {}, {:.1f} ms\n{}", format_bytes(step.peak),
                     1e3 * step_seconds, step.table());
  return out;
}

std::string ModuleProfile::to_json() const {
  nlohmann::json j = {{"batch", batch},
                      {"precision", to_string(precision)},
                      {"chains", nlohmann::json::array()},
                      {"predicted_step_peak_bytes", predicted.peak_bytes},
                      {"predicted_step_seconds", predicted.seconds},
                      {"predicted_memory", nlohmann::json::parse(predicted.memory.to_json())},
                      {"measured_step_peak_bytes", step.peak},
                      {"measured_memory", nlohmann::json::parse(step.to_json())},
                      {"measured_step_seconds", step_seconds}};
  for (size_t c = 0; c < chains.size(); ++c) {
    j["chains"].push_back({{"name", chains[c]}, {"layers", nlohmann::json::parse(layers[c].to_json())}});
  }
  return j.dump(2);
}

TrainerOptions ModuleBatchSearch::apply(const ModuleBatchFound& found, torch::nn::Module& module,
                                        TrainerOptions base) const {
  TORCH_CHECK(found.batch > 0, "ModuleBatchSearch::apply: not even a batch of 1 fits ", format_bytes(budget),
              "; nothing to apply");
  set_schedules(module, chains, found.schedules, "ModuleBatchSearch::apply");
  return trainer_options(StepSettings(found.settings).micro_batch(0), std::move(base)).batch_size(found.batch);
}

namespace {
nlohmann::json found_json(const ModuleBatchFound& f, const std::vector<std::string>& chains) {
  return {{"batch", f.batch},
          {"precision", to_string(f.settings.precision())},
          {"offload", offload_text(f.settings)},
          {"selective_recompute", f.settings.selective_recompute()},
          {"checkpoint", detail::checkpoint_text(chains, f.schedules)},
          {"chains", nlohmann::json::parse(checkpoint_json(chains, f.schedules))},
          {"predicted_peak_bytes", f.predicted_peak_bytes},
          {"measured_peak_bytes", f.measured_peak_bytes},
          {"verified", f.verified},
          {"verification_runs", f.attempts}};
}

std::string found_text(const char* what, const ModuleBatchFound& f, const std::vector<std::string>& chains,
                       int64_t budget) {
  if (f.batch == 0) return fmt::format("{}: not even a batch of 1 fits {}\n", what, format_bytes(budget));
  return fmt::format("{}: batch {} ({}, offload {}; checkpoint {}), predicted peak {}{}\n", what, f.batch,
                     to_string(f.settings.precision()), offload_text(f.settings), detail::schedules_text(chains, f.schedules),
                     format_bytes(f.predicted_peak_bytes),
                     f.verified ? fmt::format(", measured {} in {} run(s)", format_bytes(f.measured_peak_bytes),
                                              f.attempts)
                                : std::string(", not verified"));
}
} // namespace

std::string ModuleBatchSearch::to_json() const {
  nlohmann::json j = {{"budget_bytes", budget},
                      {"chains", chains},
                      {"plain", found_json(plain, chains)},
                      {"with_techniques", found_json(techniques, chains)}};
  return j.dump(2);
}

std::string ModuleBatchSearch::explain() const {
  return fmt::format("largest batch in one pass under {}:\n", format_bytes(budget)) +
         found_text("  plainly", plain, chains, budget) +
         found_text("  with checkpointing, offload and precision", techniques, chains, budget);
}

} // namespace memfit
