#include "plan_choice.h"

#include "plan_report.h"

#include "memfit/environment.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>

namespace memfit {
namespace detail {

int64_t largest_fitting(int64_t top, const std::function<bool(int64_t)>& fits) {
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = top;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

bool may_micro_batch(const PlanOptions& o, const std::optional<std::string>& layer) {
  return o.micro_batching() && (!layer || o.batch_statistics() == BatchStatistics::kPerMicroBatch);
}

bool time_predictable(const ModuleStepModel::Impl& im, int64_t micro) {
  return micro <= kTimeExtrapolation * im.m_large;
}

bool is_edge(const PlanOptions& o, bool can_time, int64_t peak, int64_t limit, int64_t budget) {
  return can_time && o.measure_candidates() > 0 && peak > limit && peak <= budget;
}

Ranked ranked(const StepSettings& settings, const StepPrediction& predicted, bool checkpoints) {
  Ranked r;
  r.seconds = predicted.seconds;
  r.recomputes = checkpoints || settings.selective_recompute() ? 1 : 0;
  r.offload = offload_rank(settings);
  r.micro_batches = predicted.accumulation_steps;
  r.lower_precision = settings.precision() == Precision::kFP32 ? 0 : 1;
  r.peak_bytes = predicted.peak_bytes;
  return r;
}

double fastest_seconds(const std::vector<Ranked>& candidates, bool with_edges) {
  double fastest = std::numeric_limits<double>::infinity();
  for (const auto& c : candidates) {
    if (with_edges || !c.edge) fastest = std::min(fastest, c.seconds);
  }
  return fastest;
}

std::tuple<int, int, int64_t, int> work(const Ranked& c) {
  return std::make_tuple(c.recomputes, c.offload, c.micro_batches, c.lower_precision);
}

int64_t choose(const std::vector<Ranked>& candidates, double tie) {
  const double fastest = fastest_seconds(candidates, /*with_edges=*/false);
  auto key = [](const Ranked& c) { return std::tuple_cat(work(c), std::make_tuple(c.seconds, c.peak_bytes)); };
  int64_t best = -1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].edge || candidates[i].seconds > fastest * (1 + tie)) continue;
    if (best < 0 || key(candidates[i]) < key(candidates[static_cast<size_t>(best)])) best = static_cast<int64_t>(i);
  }
  return best;
}

bool same_math(const Ranked& a, const Ranked& b) {
  return a.micro_batches == b.micro_batches && a.lower_precision == b.lower_precision;
}

double tie_between(const Ranked& a, const Ranked& b, double tie) {
  return same_math(a, b) ? tie : std::max(kMathTie, tie);
}

int64_t choose_timed(const std::vector<Ranked>& ran, double tie) {
  const double fastest = fastest_seconds(ran, /*with_edges=*/false);
  const double band = std::max(kMathTie, tie);
  std::vector<Ranked> picks;
  std::vector<size_t> at;
  std::vector<bool> seen(ran.size(), false);
  for (size_t i = 0; i < ran.size(); ++i) {
    if (seen[i] || ran[i].edge) continue;
    std::vector<size_t> members;
    for (size_t j = i; j < ran.size(); ++j) {
      if (ran[j].edge || !same_math(ran[i], ran[j])) continue;
      seen[j] = true;
      members.push_back(j);
    }
    double set_fastest = std::numeric_limits<double>::infinity();
    for (size_t j : members) set_fastest = std::min(set_fastest, ran[j].seconds);
    std::vector<Ranked> running;
    std::vector<size_t> where;
    for (size_t j : members) {
      if (ran[j].seconds > set_fastest * (1 + tie) || ran[j].seconds > fastest * (1 + band)) continue;
      running.push_back(ran[j]);
      where.push_back(j);
    }
    if (running.empty()) continue;
    const auto pick = static_cast<size_t>(choose(running, std::numeric_limits<double>::infinity()));
    picks.push_back(running[pick]);
    at.push_back(where[pick]);
  }
  const int64_t chosen = choose(picks, std::numeric_limits<double>::infinity());  // each within its band already
  return chosen < 0 ? -1 : static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
}

std::vector<size_t> close_variants(const std::vector<Ranked>& candidates, std::vector<size_t> at, size_t pick,
                                   double fastest) {
  std::stable_sort(at.begin(), at.end(),
                   [&](size_t a, size_t b) { return candidates[a].offload < candidates[b].offload; });
  std::vector<size_t> out;
  std::vector<int64_t> families;
  for (size_t i : at) {
    const int64_t f = candidates[i].family;
    if (i != pick && candidates[i].seconds > fastest * (1 + kTimedVariants)) continue;
    if (f >= 0 && std::find(families.begin(), families.end(), f) != families.end()) continue;
    families.push_back(f);
    if (i != pick) out.push_back(i);
  }
  return out;
}

std::vector<size_t> to_time(const std::vector<Ranked>& candidates, const std::vector<int64_t>& group,
                            double within, int64_t count) {
  std::vector<size_t> order;
  if (candidates.empty() || count <= 0) return order;
  const auto by_prediction = [&](size_t a, size_t b) {
    return std::make_pair(candidates[a].seconds, a) < std::make_pair(candidates[b].seconds, b);
  };
  std::map<int64_t, std::vector<size_t>> members;
  for (size_t i = 0; i < candidates.size(); ++i) members[group[i]].push_back(i);
  std::vector<size_t> picks;
  std::map<size_t, std::vector<size_t>> close;  // a group's pick: its group's others within kTimedVariants
  for (const auto& [g, at] : members) {
    std::vector<Ranked> sub;
    for (size_t i : at) {
      sub.push_back(candidates[i]);
      sub.back().edge = false;  // an edge group's own pick is timed like any other
    }
    const size_t pick = at[static_cast<size_t>(choose(sub))];
    picks.push_back(pick);
    close[pick] = close_variants(candidates, at, pick, fastest_seconds(sub, /*with_edges=*/true));
    std::sort(close[pick].begin(), close[pick].end(), by_prediction);
  }
  const double fastest = fastest_seconds(candidates, /*with_edges=*/true);
  picks.erase(std::remove_if(picks.begin(), picks.end(),
                             [&](size_t i) { return candidates[i].seconds > fastest * (1 + within); }),
              picks.end());
  std::sort(picks.begin(), picks.end(), by_prediction);
  const auto add = [&](size_t i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  };
  if (const int64_t predicted = choose(candidates); predicted >= 0) {
    add(static_cast<size_t>(predicted));
    const auto own = std::find_if(picks.begin(), picks.end(), [&](size_t p) {
      return group[p] == group[static_cast<size_t>(predicted)];
    });
    if (own != picks.end()) {
      add(*own);
      for (size_t i : close[*own]) add(i);
    }
  }
  for (size_t p : picks) add(p);
  for (size_t p : picks) {
    for (size_t i : close[p]) add(i);
  }
  if (static_cast<int64_t>(order.size()) > count) order.resize(static_cast<size_t>(count));
  return order;
}

int64_t timing_group(const StepSettings& s, bool edge) {
  return (s.micro_batch() * 16 + static_cast<int64_t>(s.precision())) * 2 + (edge ? 1 : 0);
}

double two_fastest_gap(std::vector<double> v) {
  std::partial_sort(v.begin(), v.begin() + 2, v.end());
  return v[1] / v[0] - 1;
}

bool contends(const std::vector<double>& v, double best) {
  return !v.empty() && *std::min_element(v.begin(), v.end()) <= best * (1 + kContender);
}

double fastest_sample(const std::vector<std::vector<double>>& samples) {
  double best = std::numeric_limits<double>::infinity();
  for (const auto& v : samples) {
    for (double x : v) best = std::min(best, x);
  }
  return best;
}

bool settled(const std::vector<std::vector<double>>& samples) {
  const double best = fastest_sample(samples);
  for (const auto& v : samples) {
    if (contends(v, best) && (v.size() < 2 || two_fastest_gap(v) > kTimeTie)) return false;
  }
  return true;
}

bool confirmed(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
               const std::vector<std::vector<double>>& samples, int passes) {
  if (passes >= kConfirmPasses) return true;
  const double best = fastest_sample(samples);
  auto key = [&](size_t k) { return work(candidates[order[k]]); };
  size_t fastest = 0;
  for (size_t k = 0; k < samples.size(); ++k) {
    if (!samples[k].empty() && *std::min_element(samples[k].begin(), samples[k].end()) == best) fastest = k;
  }
  for (size_t k = 0; k < samples.size(); ++k) {
    if (samples[k].empty() || key(k) >= key(fastest)) continue;
    const double tie = tie_between(candidates[order[k]], candidates[order[fastest]], kTimeTie);
    if (*std::min_element(samples[k].begin(), samples[k].end()) > best * (1 + tie)) return false;
  }
  return true;
}

double timing_noise(const std::vector<std::vector<double>>& samples) {
  if (settled(samples)) return 0;
  const double best = fastest_sample(samples);
  double noise = 0;
  for (const auto& v : samples) {
    if (contends(v, best) && v.size() >= 2) noise = std::max(noise, two_fastest_gap(v));
  }
  return noise;
}

bool busy_machine(double free_cores, int threads, double noise) {
  return free_cores >= 0 ? free_cores < double(threads) - 0.5 : noise > kBusy;
}

int64_t does_least(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                   const std::vector<bool>& out_of_memory) {
  std::vector<Ranked> fit;
  std::vector<size_t> at;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto k = static_cast<size_t>(std::find(order.begin(), order.end(), i) - order.begin());
    if (candidates[i].edge || (k < order.size() && out_of_memory[k])) continue;
    fit.push_back(candidates[i]);
    fit.back().seconds = 0;
    at.push_back(i);
  }
  const int64_t chosen = choose(fit);
  return chosen < 0 ? -1 : static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
}

void offload_adds_copies(std::vector<Ranked>& candidates) {
  const auto measured = candidates;
  for (auto& c : candidates) {
    for (const auto& less : measured) {
      if (c.family >= 0 && less.family == c.family && less.offload < c.offload) {
        c.seconds = std::max(c.seconds, less.seconds);
      }
    }
  }
}

Measured choose_measured(const std::vector<Ranked>& candidates, const std::vector<size_t>& order,
                         const std::function<StepTiming(size_t)>& run,
                         std::function<double()> free_cores) {
  Measured out;
  const CpuLoad load;
  if (!free_cores) free_cores = [&load] { return load.free_cores(); };
  out.timed.assign(order.size(), StepTiming{});
  std::vector<std::vector<double>> samples(order.size());
  std::vector<bool> out_of_memory(order.size(), false);
  // More passes settle noise, not a busy machine's turns: those stop at kMinPasses.
  const auto busy_now = [&] {
    const double free = free_cores();
    return free >= 0 && busy_machine(free, at::get_num_threads(), 0);
  };
  for (; out.passes < kMaxPasses &&
         (out.passes < kMinPasses ||
          ((!settled(samples) || !confirmed(candidates, order, samples, out.passes)) && !busy_now()));
       ++out.passes) {
    for (size_t n = 0; n < order.size(); ++n) {
      const size_t k = out.passes % 2 == 0 ? n : order.size() - 1 - n;
      if (out_of_memory[k]) continue;
      const auto r = run(order[k]);
      out.timed[k].peak_bytes = std::max(out.timed[k].peak_bytes, r.peak_bytes);
      out_of_memory[k] = r.seconds <= 0;
      if (out_of_memory[k]) {
        out.timed[k].failed_allocated = r.failed_allocated;
        out.timed[k].failed_reserved = r.failed_reserved;
      }
      if (out_of_memory[k]) samples[k].clear();
      else samples[k].push_back(r.seconds);
    }
  }
  std::vector<Ranked> ran;
  std::vector<size_t> at;  // each of ran's index into timed
  for (size_t k = 0; k < order.size(); ++k) {
    if (samples[k].empty()) continue;
    out.timed[k].seconds = *std::min_element(samples[k].begin(), samples[k].end());
    ran.push_back(candidates[order[k]]);
    ran.back().seconds = out.timed[k].seconds;
    ran.back().edge = false;  // its steps ran under the budget: it fits
    at.push_back(k);
  }
  offload_adds_copies(ran);
  out.tie = std::max(kTimeTie, timing_noise(samples));
  out.free_cores = free_cores();
  if (busy_machine(out.free_cores, at::get_num_threads(), out.tie)) {
    out.chosen = does_least(candidates, order, out_of_memory);
    out.busy = out.chosen >= 0;
    if (out.busy) return out;
  }
  const int64_t chosen = choose_timed(ran, out.tie);
  if (chosen < 0) return out;
  out.chosen_timed = static_cast<int64_t>(at[static_cast<size_t>(chosen)]);
  out.chosen = static_cast<int64_t>(order[static_cast<size_t>(out.chosen_timed)]);
  return out;
}

} // namespace detail

namespace {

bool same_segments(const std::vector<Segment>& a, const std::vector<Segment>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].begin != b[i].begin || a[i].end != b[i].end || a[i].checkpointed != b[i].checkpointed ||
        !same_segments(a[i].inner, b[i].inner)) {
      return false;
    }
  }
  return true;
}

// Examples a timed or verifying step of `batch` runs with `s` (see kTimedExamples).
int64_t timed_examples(const StepSettings& s, int64_t batch) {
  const int64_t m = s.micro_batch() > 0 ? s.micro_batch() : batch;
  if (batch <= detail::kTimedExamples || m >= batch) return batch;
  return std::min(batch, std::max<int64_t>(2, detail::kTimedExamples / m) * m);
}

} // namespace

namespace {
// Whether `a` and `b` run the same step, whatever they offload: micro-batch,
// precision, selective recomputation and every chain's schedule (a family
// whose members differ only in their copies).
bool same_step(const Candidate& a, const Candidate& b) {
  const auto& s = a.settings;
  const auto& t = b.settings;
  if (s.micro_batch() != t.micro_batch() || s.precision() != t.precision() ||
      s.selective_recompute() != t.selective_recompute() || a.schedules.size() != b.schedules.size()) {
    return false;
  }
  for (size_t c = 0; c < a.schedules.size(); ++c) {
    const bool ra = detail::recomputes(a.schedules[c]);
    if (ra != detail::recomputes(b.schedules[c])) return false;
    if (ra && !same_segments(a.schedules[c].segments, b.schedules[c].segments)) return false;
  }
  return true;
}
} // namespace

bool same_candidate(const Candidate& a, const Candidate& b) {
  const auto& s = a.settings;
  const auto& t = b.settings;
  return same_step(a, b) && s.offload_optimizer() == t.offload_optimizer() &&
         s.offload_gradients() == t.offload_gradients() && s.offload_parameters() == t.offload_parameters() &&
         s.tile_bytes() == t.tile_bytes();
}

Search search(const ModuleStepModel& model, const ModuleStepModel::Impl& im, int64_t batch, int64_t budget,
              bool micro_batching, double room, const std::function<bool(const StepSettings&)>& allowed) {
  const auto& o = im.options;
  const auto& chains = im.chains;
  const int64_t limit = static_cast<int64_t>(std::floor(o.margin() * room * double(budget)));
  std::vector<int64_t> micro = {batch};
  const int64_t smallest = im.batch_statistics ? 2 : 1;  // batch statistics need two examples
  while (micro_batching && (micro.back() + 1) / 2 >= smallest && micro.back() > 1) {
    micro.push_back((micro.back() + 1) / 2);
  }
  Search out;
  for (const auto& measured : model.measured_settings()) {
    for (int64_t m : micro) {
      auto s = StepSettings(measured).micro_batch(m == batch ? 0 : m);
      if (allowed && !allowed(s)) continue;
      Candidate c{s, std::vector<Schedule>(chains.size()), model.predict(batch, s, {})};
      ++out.candidates;
      if (detail::is_edge(o, o.verify(), c.predicted.peak_bytes, limit, budget)) {
        out.fitting.push_back(c);  // timed, never chosen by prediction (best_fitting keeps to the limit)
        out.fitting.back().edge = true;
      }
      // Streamed chains run as measured: their layers come one at a time, and
      // those recomputed keep only their input already (no schedule on top).
      const bool streamed = s.offload_parameters() == Offload::kHost;
      if (c.predicted.peak_bytes > limit && o.checkpointing() && !chains.empty() && !streamed) {
        const auto& meas = im.find(s);
        auto solved = solve_chains(model, meas, batch, s, limit, im.m_small, im.m_large, false);
        c.schedules = solved ? *solved : *solve_chains(model, meas, batch, s, limit, im.m_small, im.m_large, true);
        c.predicted = model.predict(batch, s, c.schedules);
      }
      if (!out.closest || c.predicted.peak_bytes < out.closest->predicted.peak_bytes) out.closest = c;
      if (c.predicted.peak_bytes <= limit) out.fitting.push_back(c);
    }
  }
  return out;
}

namespace {
// Every index of `candidates`.
std::vector<size_t> all_of(const std::vector<Candidate>& candidates) {
  std::vector<size_t> out(candidates.size());
  std::iota(out.begin(), out.end(), size_t{0});
  return out;
}
} // namespace

std::optional<size_t> best_fitting(const std::vector<Candidate>& all, double correction, int64_t limit,
                                   double tie) {
  return best_fitting(all, all_of(all), correction, limit, tie);
}

std::optional<size_t> best_fitting(const std::vector<Candidate>& all, const std::vector<size_t>& pool,
                                   double correction, int64_t limit, double tie) {
  std::vector<detail::Ranked> ranked;
  std::vector<size_t> at;
  for (size_t i : pool) {
    const auto& c = all[i];
    if (double(c.predicted.peak_bytes) * correction > double(limit)) continue;
    ranked.push_back(detail::ranked(c.settings, c.predicted, any_recompute(c.schedules)));
    at.push_back(i);
  }
  const int64_t chosen = detail::choose(ranked, tie);
  if (chosen < 0) return std::nullopt;
  return at[static_cast<size_t>(chosen)];
}

detail::StepTiming run_plan(const ModuleStepModel& model, const ModuleStepModel::Impl& im, const Candidate& c,
                            int64_t batch, int64_t budget, int steps) {
  const int64_t examples = timed_examples(c.settings, batch);
  detail::ModuleStateGuard restore(*im.probe.module);
  compat::WarningCapture quiet;  // the Trainer's warnings repeat what the plan says
  ChainSchedules scheduled(im.chains, c.schedules);
  SelectiveRecomputeGuard selective(*im.probe.module, c.settings.selective_recompute());
  auto trainer = im.probe.make_trainer(  // an out-of-memory error is the answer here, not something to recover
      trainer_options(c.settings, im.base).batch_size(examples).save_dir("").on_out_of_memory(OnOutOfMemory::kThrow));
  const int64_t outer = memory_budget(im.base.device());  // a caller's lower budget stays
  BudgetGuard scope(im.base.device(), outer > 0 ? std::min(outer, budget) : budget);
  detail::StepTiming out;
  try {
    for (int k = 0; k < steps; ++k) {
      const auto rec = im.probe.step(trainer, examples);
      if (k == 0) continue;
      out.peak_bytes = std::max(out.peak_bytes, rec.peak_bytes);
      out.seconds = k == 1 ? rec.seconds : std::min(out.seconds, rec.seconds);
    }
  } catch (const c10::OutOfMemoryError&) {
    detail::StepTiming failed{0, -1};
    const auto device = im.base.device();
    if (device.is_cuda()) {  // the failing phase's peaks: each phase's meter resets the device's
      failed.failed_allocated = max_memory_allocated(device);
      failed.failed_reserved = max_memory_reserved(device);
    }
    return failed;
  }
  if (examples < batch) {
    const double part = model.predict(examples, c.settings, c.schedules).seconds;
    if (part > 0) out.seconds *= model.predict(batch, c.settings, c.schedules).seconds / part;
  }
  return out;
}

std::optional<size_t> TimedRound::chosen_at() const {
  for (size_t k = 0; k < order.size(); ++k) {
    if (static_cast<int64_t>(order[k]) == measured.chosen) return k;
  }
  return std::nullopt;
}

namespace {

// Streaming the chains' parameters is the rung after the optimizer state and
// gradients on the host, so its settings are measured only where nothing
// resident is predicted to fit the limit, or where the fastest resident fit
// already holds both on the host: there a larger micro-batch streamed may be
// faster (the GPU peer table's GPT at 101.96 MiB, docs/workloads.md: streamed
// micro-batches of 4 ran at 19x the plain step on an H200; without streaming
// measured, resident micro-batches of 1 at 46x on an H100).
bool wants_streaming(const Search& found, int64_t limit) {
  const auto best = best_fitting(found.fitting, 1.0, limit);
  return !best || found.fitting[*best].settings.offload_gradients() == Offload::kHost;
}

// The candidates `pool` that PlanOptions::measure_candidates names
// (detail::to_time), timed with real steps under the budget.
TimedRound time_candidates(const ModuleStepModel& model, const ModuleStepModel::Impl& im, const Decision& d,
                           const std::vector<size_t>& pool) {
  std::vector<detail::Ranked> ranked;
  std::vector<int64_t> group;
  std::vector<size_t> families;  // each family's first candidate: one step, more or fewer copies (same_step)
  for (size_t i : pool) {
    const auto& c = d.candidates[i];
    ranked.push_back(detail::ranked(c.settings, c.predicted, any_recompute(c.schedules)));
    ranked.back().edge = c.edge;
    const auto family = std::find_if(families.begin(), families.end(),
                                     [&](size_t f) { return same_step(d.candidates[f], c); });
    ranked.back().family = family - families.begin();
    if (family == families.end()) families.push_back(i);
    group.push_back(detail::timing_group(c.settings, c.edge));
  }
  const auto& o = im.options;
  const auto order = detail::to_time(ranked, group, o.measure_within(), o.measure_candidates());
  TimedRound out;
  out.measured = detail::choose_measured(
      ranked, order, [&](size_t i) { return run_plan(model, im, d.candidates[pool[i]], d.batch, d.budget, 2); },
      o.free_cores());
  if (out.measured.chosen >= 0) out.measured.chosen = static_cast<int64_t>(pool[static_cast<size_t>(out.measured.chosen)]);
  for (size_t k : order) {
    out.order.push_back(pool[k]);
    out.part_batches = out.part_batches || timed_examples(d.candidates[pool[k]].settings, d.batch) < d.batch;
  }
  return out;
}

// The least allocated ÷ reserved bytes of the candidates whose steps ran out
// of memory on CUDA with the caching allocator holding more than they
// allocated (1: none did).
double reserved_room(const TimedRound& round) {
  double room = 1.0;
  for (const auto& t : round.measured.timed) {
    if (t.failed_reserved > t.failed_allocated && t.failed_allocated > 0) {
      room = std::min(room, double(t.failed_allocated) / double(t.failed_reserved));
    }
  }
  return room;
}

// On CUDA the budget caps the caching allocator's reserved bytes, and
// fragmentation (recomputation's churn most) can hold more than the step
// allocates: some timed candidates ran out of memory with their allocated
// bytes below the budget (docs/workloads.md: the GPT on the H100 at 323 MiB).
// The grid is searched again with the limit scaled by the `room` they left,
// so that schedules are solved for what the allocator lets the step
// allocate, and those not yet timed are timed; the faster of their choice
// and `best` (as detail::choose_timed settles measured times) stands.
std::optional<size_t> within_reserved(const ModuleStepModel& model, const ModuleStepModel::Impl& im, Decision& d,
                                      double room, std::optional<size_t> best) {
  auto again = search(model, im, d.batch, d.budget, d.micro_batching, room);
  std::vector<size_t> fresh;
  for (auto& c : again.fitting) {
    const bool timed = std::any_of(d.rounds.begin(), d.rounds.end(), [&](const TimedRound& r) {
      return std::any_of(r.order.begin(), r.order.end(), [&](size_t i) { return same_candidate(d.candidates[i], c); });
    });
    if (c.edge || timed) continue;
    d.candidates.push_back(std::move(c));
    fresh.push_back(d.candidates.size() - 1);
  }
  if (fresh.empty()) return best;
  d.room = room;
  d.rounds.push_back(time_candidates(model, im, d, fresh));
  const auto& round = d.rounds.back();
  if (round.measured.chosen < 0) return best;
  const auto at = round.chosen_at();
  const double seconds = at ? round.measured.timed[*at].seconds : 0.0;
  if (best && d.measured_seconds > 0) {
    const auto& b = d.candidates[*best];
    const auto& c = d.candidates[static_cast<size_t>(round.measured.chosen)];
    std::vector<detail::Ranked> measured = {detail::ranked(b.settings, b.predicted, any_recompute(b.schedules)),
                                            detail::ranked(c.settings, c.predicted, any_recompute(c.schedules))};
    measured[0].seconds = d.measured_seconds;
    measured[1].seconds = seconds;
    if (detail::choose_timed(measured, detail::kTimeTie) == 0) {
      d.kept_earlier = true;
      return best;
    }
  }
  d.measured_seconds = seconds;
  d.measured_peak_bytes = at ? round.measured.timed[*at].peak_bytes : 0;
  return static_cast<size_t>(round.measured.chosen);
}

// The plan with its steps run under the budget (PlanOptions::verify): `first`
// where there is one (a busy machine's choice that was not timed), then the
// best of `pool` by prediction. A candidate whose steps overrun the budget
// scales every later prediction by how far it was off (Decision::overruns);
// kVerifyAttempts run in all. Without verify the first is chosen unrun.
// nullopt: none ran within the budget.
std::optional<size_t> verified_choice(const ModuleStepModel& model, const ModuleStepModel::Impl& im, Decision& d,
                                      std::vector<size_t> pool, std::optional<size_t> first) {
  double correction = 1.0;
  for (int attempts = 0; !pool.empty() && attempts < detail::kVerifyAttempts;) {
    const auto pick = first ? first : best_fitting(d.candidates, pool, correction, d.limit);  // fits after the correction
    first.reset();
    if (!pick) break;
    pool.erase(std::remove(pool.begin(), pool.end(), *pick), pool.end());
    if (!model.options().verify()) return pick;
    ++attempts;
    const auto& c = d.candidates[*pick];
    const int64_t measured = run_plan(model, im, c, d.batch, d.budget).peak_bytes;
    if (measured >= 0 && measured <= d.budget) {
      d.measured_peak_bytes = measured;
      return pick;
    }
    correction = std::max(correction * 1.01, double(measured >= 0 ? measured : d.budget) /
                                                 double(c.predicted.peak_bytes) * (measured >= 0 ? 1.0 : 1.02));
    d.overruns.push_back({*pick, measured});
  }
  return std::nullopt;
}

} // namespace

Decision decide(const ModuleStepModel& model, ModuleStepModel::Impl& im, int64_t budget, int64_t batch) {
  const auto& o = im.options;
  Decision d;
  d.budget = budget;
  d.batch = batch;
  d.limit = static_cast<int64_t>(std::floor(o.margin() * double(budget)));
  d.plain = model.predict(batch, im.plain_settings(), {});
  d.micro_batching = detail::may_micro_batch(o, im.batch_statistics);
  auto found = search(model, im, batch, budget, d.micro_batching);
  if (wants_streaming(found, d.limit) && im.measure_held_back()) {
    found = search(model, im, batch, budget, d.micro_batching);
  }
  d.considered = found.candidates;
  d.closest = std::move(found.closest);
  d.candidates = std::move(found.fitting);
  const auto searched = all_of(d.candidates);
  std::optional<size_t> best;
  if (o.verify() && o.measure_candidates() > 0 && !d.candidates.empty()) {
    d.rounds.push_back(time_candidates(model, im, d, searched));
    const auto& round = d.rounds.back();
    if (round.measured.chosen >= 0) best = static_cast<size_t>(round.measured.chosen);
    if (const auto at = round.chosen_at()) {
      d.measured_seconds = round.measured.timed[*at].seconds;
      d.measured_peak_bytes = round.measured.timed[*at].peak_bytes;
    }
    const double room = reserved_room(round);
    if (room < 1.0) best = within_reserved(model, im, d, room, best);
    d.measured_tie = d.rounds.back().measured.tie;
  }
  // On a busy machine the choice is what the plans do, among all predicted to
  // fit (detail::choose_measured), and it may not have been timed: its steps
  // run under the budget as those timed did, before any other's.
  if (!best || d.measured_peak_bytes == 0) best = verified_choice(model, im, d, searched, best);
  if (best) {
    d.chosen = static_cast<int64_t>(*best);
    const auto& c = d.candidates[*best];
    const bool predictable = detail::time_predictable(im, detail::micro_batch_of(c.settings, batch));
    d.step_seconds = d.measured_seconds > 0 ? d.measured_seconds : predictable ? c.predicted.seconds : 0.0;
  }
  return d;
}

} // namespace memfit
