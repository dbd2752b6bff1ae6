#include "plan_report.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace memfit {
namespace detail {

std::string micro_batch_text(const PlanOptions& o, const std::optional<std::string>& layer,
                             int64_t micro, int64_t steps, int64_t batch) {
  if (steps > 1 && layer) {
    return fmt::format("micro-batches of {} ({} per batch of {}): one micro-batch of activations at a time; "
                       "the math changes: BatchNorm layer '{}' (and any other) normalises each micro-batch of {} "
                       "with its own statistics, not the batch of {} (allowed by PlanOptions::batch_statistics(kPerMicroBatch))",
                       micro, steps, batch, *layer, micro, batch);
  }
  if (steps > 1) {
    return fmt::format("micro-batches of {} ({} per batch of {}): one micro-batch of activations at a time, "
                       "the same gradient", micro, steps, batch);
  }
  if (layer && o.micro_batching() && !may_micro_batch(o, layer)) {
    return fmt::format("no micro-batching: the whole batch at once, as BatchNorm layer '{}' needs for the "
                       "batch's statistics (PlanOptions::batch_statistics(kPerMicroBatch) lets micro-batches "
                       "change them)", *layer);
  }
  return "no micro-batching: the whole batch at once";
}

std::vector<std::string> settings_lines(const StepSettings& s, bool selective_measured,
                                        const std::string& checkpoint) {
  std::vector<std::string> out;
  out.push_back(s.precision() == Precision::kFP32
                    ? std::string("precision fp32: the math is unchanged")
                    : fmt::format("precision {}: autocast lowers activation bytes and time (numerics change "
                                  "within autocast's tolerance)", to_string(s.precision())));
  if (selective_measured) {
    out.push_back(s.selective_recompute()
                      ? std::string("selective recomputation: the model's SelectivelyRecomputed parts (make_gpt's "
                                    "blocks: attention scores, softmax and attention dropout) are recomputed in "
                                    "backward instead of kept")
                      : std::string("no selective recomputation: the SelectivelyRecomputed parts keep what they mark"));
  }
  out.push_back(checkpoint.empty() ? std::string("no checkpointing: every activation is kept")
                                   : fmt::format("checkpoint schedule {} (optimal for the memory left): "
                                                 "recomputation instead of storage", checkpoint));
  out.push_back(s.offload_optimizer() == Offload::kHost
                    ? std::string("optimizer state in host memory, stepped there")
                    : std::string("optimizer state on the device"));
  if (s.offload_gradients() == Offload::kHost) {
    out.push_back("gradients moved to the host as backward produces them (accumulated there): "
                  "the device holds about one parameter's gradient at a time");
  }
  if (s.offload_parameters() == Offload::kHost) {
    out.push_back(fmt::format(
        "parameters in host memory, streamed to the device layer by layer ({}): every parameter crosses twice "
        "per micro-batch{}, layers other than Linear run forward once more",
        s.tile_bytes() > 0 ? fmt::format("Linear weights in tiles of at most {}", format_bytes(s.tile_bytes()))
                           : std::string("untiled"),
        ""));
  }
  return out;
}

std::string unlock_text(const PlanOptions& o, const std::optional<std::string>& layer) {
  std::string text;
  if (layer && o.micro_batching() && !may_micro_batch(o, layer)) {
    text += fmt::format("; micro-batches were not tried because BatchNorm layer '{}' would normalise each with "
                        "its own statistics: PlanOptions::batch_statistics(kPerMicroBatch) allows them", *layer);
  }
  const bool lower = std::any_of(o.precisions().begin(), o.precisions().end(),
                                 [](Precision p) { return p != Precision::kFP32; });
  std::vector<std::string> more;
  if (!lower) more.push_back("PlanOptions::precisions({kFP32, kBF16}) (bf16 changes the math)");
  if (!o.micro_batching()) more.push_back("PlanOptions::micro_batching(true)");
  if (!o.checkpointing()) more.push_back("PlanOptions::checkpointing(true)");
  if (!o.offload()) more.push_back("PlanOptions::offload(true)");
  if (!more.empty()) text += fmt::format("; less may fit with {}", fmt::join(more, ", "));
  return text;
}

std::string settings_text(const StepSettings& s, int64_t batch) {
  const int64_t m = s.micro_batch() > 0 ? s.micro_batch() : batch;
  return fmt::format("micro-batch {}, {}, offload {}{}{}", m, to_string(s.precision()), offload_text(s),
                     s.tile_bytes() > 0 ? ", tiles of " + format_bytes(s.tile_bytes()) : "",
                     s.selective_recompute() ? ", selective recomputation" : "");
}

std::string edge_text(bool edge, int64_t peak_bytes) {
  return edge ? fmt::format(" (predicted peak {}, above PlanOptions::margin of the budget: its steps decide)",
                            format_bytes(peak_bytes))
              : std::string();
}

std::string edge_chosen_text(int64_t predicted_peak, int64_t limit, const PlanOptions& o,
                             int64_t measured_peak) {
  return fmt::format("predicted peak {} is above the limit {} ({:.0f}% of the budget), but its real steps under "
                     "the budget peaked at {}: they, not the margin, say it fits",
                     format_bytes(predicted_peak), format_bytes(limit), 100 * o.margin(), format_bytes(measured_peak));
}

std::string out_of_memory_text(const StepTiming& t) {
  return t.failed_reserved > 0
             ? fmt::format("ran out of memory under the budget (allocated bytes peaked at {}; the caching "
                           "allocator's reserved bytes, which the budget caps, at {})",
                           format_bytes(t.failed_allocated), format_bytes(t.failed_reserved))
             : std::string("ran out of memory under the budget");
}

std::string threads_advice(double free_cores, int threads) {
  if (free_cores < 0) return {};
  const int fit = std::max(1, static_cast<int>(std::lround(free_cores)));
  return fit < threads ? fmt::format("; at::set_num_threads({}) would give LibTorch's threads cores of their own "
                                     "(threads that take turns with other processes wait on each other, and steps "
                                     "slow many times over)",
                                     fit)
                       : std::string();
}

std::string math_tie_text(double tie) {
  return kMathTie > tie ? fmt::format(" ({:.0f}% between micro-batch sizes or precisions, which change what a step "
                                      "computes)", 100 * kMathTie)
                        : std::string();
}

std::string choice_text(const std::vector<std::string>& names, const Measured& m) {
  if (m.busy) return "chose by what the plans do";
  if (m.chosen < 0 || m.chosen_timed < 0) return "none ran, so the prediction chooses";
  const auto c = static_cast<size_t>(m.chosen_timed);
  size_t fastest = c;
  for (size_t k = 0; k < m.timed.size(); ++k) {
    if (m.timed[k].seconds > 0 && m.timed[k].seconds < m.timed[fastest].seconds) fastest = k;
  }
  if (fastest == c) return "chose the fastest measured";
  return fmt::format("chose {}, {:.1f}% behind the fastest measured ({}): within the tie, what a plan does "
                     "decides ({})",
                     names[c], 100 * (m.timed[c].seconds / m.timed[fastest].seconds - 1), names[fastest], kWorkOrder);
}

std::string timed_text(const std::vector<std::string>& names, const std::vector<double>& predicted,
                       const Measured& m) {
  std::vector<std::string> lines;
  for (size_t k = 0; k < names.size(); ++k) {
    lines.push_back(fmt::format("{}: predicted {:.1f} ms, {}", names[k], 1e3 * predicted[k],
                                m.timed[k].seconds > 0
                                    ? fmt::format("measured {:.1f} ms", 1e3 * m.timed[k].seconds)
                                    : out_of_memory_text(m.timed[k])));
  }
  const std::string tie =
      m.busy ? fmt::format("{}: a busy machine's times cannot tell plans apart, so of all those predicted to fit, "
                           "the one that does least ({}, then fewer bytes) is chosen{}",
                           m.free_cores >= 0
                               ? fmt::format("other processes left {:.1f} free cores for LibTorch's {} threads",
                                             m.free_cores, at::get_num_threads())
                               : fmt::format("the timed steps spread by {:.0f}%, more than {:.0f}%", 100 * m.tie,
                                             100 * kBusy),
                           kWorkOrder, threads_advice(m.free_cores, at::get_num_threads()))
      : m.tie > kTimeTie ? fmt::format("times within {:.0f}% are a tie: the timing's own noise, as the passes did "
                                       "not settle{}", 100 * m.tie, math_tie_text(m.tie))
                         : fmt::format("times within {:.0f}% are a tie{}", 100 * kTimeTie, math_tie_text(m.tie));
  return fmt::format("timed the {} closest candidate(s) with real steps under the budget, in {} passes, every "
                     "other one in reverse order (each a warm-up step and a timed one; a candidate's fastest "
                     "timed step counts; {}): {}; {}",
                     names.size(), m.passes, tie, fmt::join(lines, "; "), choice_text(names, m));
}

// Each chain's name and schedule.
std::string schedules_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s) {
  if (chains.empty()) return "none (no chain)";
  std::string out;
  for (size_t c = 0; c < chains.size(); ++c) {
    if (!out.empty()) out += "; ";
    const auto name = chains[c].empty() ? std::string("(the module)") : chains[c];
    out += name + ": " + (c < s.size() && recomputes(s[c]) ? s[c].to_string() : std::string("none"));
  }
  return out;
}

// What the chains recompute: their schedules, or `none` where none does.
std::string checkpoint_text(const std::vector<std::string>& chains, const std::vector<Schedule>& s,
                            const std::string& none) {
  return any_recompute(s) ? schedules_text(chains, s) : none;
}

std::string candidate_text(const Candidate& c, int64_t batch, const std::vector<std::string>& chains) {
  return settings_text(c.settings, batch) + "; checkpoint " + schedules_text(chains, c.schedules);
}

} // namespace detail

namespace {

// The precisions measured, in a line of text.
std::string precisions_text(const PlanOptions& o) {
  std::string out;
  for (auto p : o.precisions()) out += (out.empty() ? "" : ", ") + to_string(p);
  return out;
}

// The offloads measured, and why streamed parameters were or were not.
std::string offloads_text(const ModuleStepModel::Impl& im) {
  const auto& o = im.options;
  const bool fp32 = std::find(o.precisions().begin(), o.precisions().end(), Precision::kFP32) != o.precisions().end();
  if (!o.offload()) return "none";
  if (!im.streams() || !fp32) return "none, optimizer, optimizer and gradients";
  if (!im.stream_refused.empty()) {
    return "none, optimizer, optimizer and gradients; parameters not streamed: " + im.stream_refused;
  }
  if (im.streamed_measured) {
    return "none, optimizer, optimizer and gradients, and in fp32 also the chains' parameters streamed";
  }
  return "none, optimizer, optimizer and gradients; the chains' parameters streamed are measured only where "
         "nothing resident fits or the fastest that does holds the optimizer state and gradients on the host";
}

// The line on one round of timed candidates, and on steps of part of the batch where some ran them.
void add_round(std::vector<std::string>& why, const TimedRound& r, const Decision& d,
               const std::vector<std::string>& chains) {
  std::vector<std::string> names;
  std::vector<double> predictions;
  for (size_t i : r.order) {
    const auto& c = d.candidates[i];
    names.push_back(detail::candidate_text(c, d.batch, chains) + detail::edge_text(c.edge, c.predicted.peak_bytes));
    predictions.push_back(c.predicted.seconds);
  }
  why.push_back(detail::timed_text(names, predictions, r.measured));
  if (r.part_batches) {
    why.push_back(fmt::format("micro-batched candidates ran steps of whole micro-batches, at least two and about "
                              "{} examples, not all {}: such a step peaks as the whole one does, and its time is "
                              "scaled to the batch by the prediction", detail::kTimedExamples, d.batch));
  }
}

// Why a step of micro-batches of `micro` has no predicted time (detail::kTimeExtrapolation).
std::string unpredictable_time_text(const ModuleStepModel::Impl& im, int64_t micro) {
  return fmt::format("micro-batches of {} are over {} times the largest measured ({}), and a line through small "
                     "steps, whose fixed costs per call dominate, is far off there", micro,
                     detail::kTimeExtrapolation, im.m_large);
}

// The lines on the chosen candidate: what it does, its predicted and measured peak and time.
void add_chosen(std::vector<std::string>& why, const ModuleStepModel::Impl& im, const Decision& d,
                const std::vector<std::string>& chains) {
  const auto& best = d.candidates[static_cast<size_t>(d.chosen)];
  why.push_back(fmt::format("chosen: {} ({} step(s)); checkpoint {}", detail::settings_text(best.settings, d.batch),
                            best.predicted.accumulation_steps, detail::schedules_text(chains, best.schedules)));
  if (best.edge) {
    why.push_back(detail::edge_chosen_text(best.predicted.peak_bytes, d.limit, im.options, d.measured_peak_bytes));
  }
  for (auto& line : detail::settings_lines(best.settings, im.selective_choices.size() > 1,
                                           detail::checkpoint_text(chains, best.schedules, ""))) {
    why.push_back(std::move(line));
  }
  // A time is shown as measured where the plan's steps were timed; a
  // prediction alone (extrapolated from small steps) is labelled as one.
  const std::string peak = fmt::format("predicted peak {} of {} ({} phase)", format_bytes(best.predicted.peak_bytes),
                                       format_bytes(d.budget), best.predicted.phase);
  const std::string ran =
      d.measured_peak_bytes > 0 ? "; its steps peaked at " + format_bytes(d.measured_peak_bytes) : std::string();
  if (d.measured_seconds > 0) {
    why.push_back(fmt::format("{}{}{} {:.1f} ms per batch (predicted {:.1f} ms)", peak, ran,
                              ran.empty() ? "; its steps took" : " and took", 1e3 * d.measured_seconds,
                              1e3 * best.predicted.seconds));
  } else if (d.step_seconds > 0) {
    why.push_back(fmt::format("{}{}; its time was not measured: {:.1f} ms per batch predicted from the measured "
                              "micro-batches ({:.2f}x plain's, likewise)",
                              peak, ran, 1e3 * best.predicted.seconds,
                              d.plain.seconds > 0 ? best.predicted.seconds / d.plain.seconds : 0.0));
  } else {
    why.push_back(fmt::format("{}{}; its time was not measured and cannot be predicted: {}", peak, ran,
                              unpredictable_time_text(im, detail::micro_batch_of(best.settings, d.batch))));
  }
  why.push_back(detail::micro_batch_text(im.options, im.batch_statistics, best.settings.micro_batch(),
                                         best.predicted.accumulation_steps, d.batch));
}

} // namespace

std::vector<std::string> plan_why(const ModuleStepModel::Impl& im, const Decision& d) {
  const auto chains = im.chain_names();
  std::vector<std::string> why;
  why.push_back(fmt::format("measured the module's step at micro-batches of {} and {}{} ({}; offload {}{}), "
                            "{} chain(s): {}",
                            im.m_small, im.m_large, im.profile_note, precisions_text(im.options), offloads_text(im),
                            im.selective_choices.size() > 1 ? "; with and without selective recomputation"
                            : im.selective_choices.front() ? "; with selective recomputation"
                                                           : "",
                            chains.size(), chains.empty() ? "none" : detail::schedules_text(chains, {})));
  why.push_back(fmt::format("plain step of {}: predicted peak {}, {}", d.batch, format_bytes(d.plain.peak_bytes),
                            detail::time_predictable(im, d.batch)
                                ? fmt::format("{:.4f} s", d.plain.seconds)
                                : "its time not predicted: " + unpredictable_time_text(im, d.batch)));
  for (size_t r = 0; r < d.rounds.size(); ++r) {
    if (r == 1) {
      why.push_back(fmt::format("on {} the budget caps the caching allocator's reserved bytes, and candidates ran "
                                "out of memory with {:.0f}% of them allocated: searched again within {:.0f}% of the "
                                "limit, and timed the new candidates against the choice so far",
                                im.base.device().str(), 100 * d.room, 100 * d.room));
    }
    add_round(why, d.rounds[r], d, chains);
  }
  if (d.kept_earlier) why.push_back("the choice so far stays: the new candidates measured no faster");
  for (const auto& o : d.overruns) {
    const auto& c = d.candidates[o.candidate];
    why.push_back(fmt::format("{} with checkpoint {}: predicted {}, but its steps {}",
                              detail::settings_text(c.settings, d.batch), detail::schedules_text(chains, c.schedules),
                              format_bytes(c.predicted.peak_bytes),
                              o.peak_bytes >= 0 ? "peaked at " + format_bytes(o.peak_bytes)
                                                : std::string("ran out of memory under the budget")));
  }
  if (d.chosen >= 0) add_chosen(why, im, d, chains);
  return why;
}

std::string nothing_fits_text(const ModuleStepModel::Impl& im, const Decision& d) {
  const auto& o = im.options;
  return fmt::format(
      "plan: nothing fits {} ({} after PlanOptions::margin) for a batch of {}: tried micro-batches of {} down to {}, "
      "precision {}, offload {}{}; the closest predicted peak is {} ({}){}{}",
      format_bytes(d.budget), format_bytes(d.limit), d.batch, d.batch,
      d.micro_batching ? (im.batch_statistics ? 2 : 1) : d.batch, precisions_text(o), offloads_text(im),
      o.checkpointing() && !im.chains.empty() ? ", checkpoint schedules for every chain" : "",
      format_bytes(d.closest->predicted.peak_bytes), detail::settings_text(d.closest->settings, d.batch),
      detail::unlock_text(o, im.batch_statistics),
      im.chains.empty() ? ". The module has no chain: hold its repeated blocks in a "
                          "memfit::CheckpointedSequential and the plan can checkpoint them"
                        : "");
}

} // namespace memfit
