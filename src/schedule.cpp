#include "memfit/schedule.h"

#include "memfit/memory.h"

#include <torch/autograd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace memfit {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

void check_layers(int64_t n) {
  TORCH_CHECK(n >= 1, "a schedule needs at least one layer, got ", n);
}

// Adds a plain segment, merging it into a plain segment just before it.
void push_plain(std::vector<Segment>& out, int64_t begin, int64_t end) {
  if (begin >= end) return;
  if (!out.empty() && !out.back().checkpointed && out.back().end == begin) {
    out.back().end = end;
    return;
  }
  out.push_back(Segment{begin, end, false, {}});
}

Segment checkpointed_plain(int64_t begin, int64_t end) {
  return Segment{begin, end, true, {Segment{begin, end, false, {}}}};
}

void append_text(const std::vector<Segment>& segments, std::string& out) {
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    if (i > 0) out += ' ';
    out += fmt::format("[{},{})", s.begin, s.end);
    if (!s.checkpointed) continue;
    out += '*';
    // A one-level checkpoint's inner schedule is just its own plain segment.
    const bool nested = !(s.inner.size() == 1 && !s.inner[0].checkpointed);
    if (nested) {
      out += '{';
      append_text(s.inner, out);
      out += '}';
    }
  }
}

void validate_cover(const std::vector<Segment>& segments, int64_t begin, int64_t end,
                    const std::string& where) {
  TORCH_CHECK(!segments.empty() || begin == end, "schedule ", where, " does not cover layers [",
              begin, ",", end, ")");
  int64_t at = begin;
  for (const auto& s : segments) {
    TORCH_CHECK(s.begin == at && s.end > s.begin, "schedule ", where, ": segment [", s.begin, ",",
                s.end, ") should start at layer ", at, " and be non-empty");
    if (s.checkpointed) {
      validate_cover(s.inner, s.begin, s.end, fmt::format("inside [{},{})", s.begin, s.end));
    } else {
      TORCH_CHECK(s.inner.empty(), "schedule ", where, ": plain segment [", s.begin, ",", s.end,
                  ") has an inner schedule");
    }
    at = s.end;
  }
  TORCH_CHECK(at == end, "schedule ", where, " covers layers up to ", at, " but needs ", end);
}

// The event-by-event simulation of the cost model (see schedule.h).
struct Simulation {
  const ChainCosts& c;
  int64_t current = 0;
  int64_t peak = 0;
  double time = 0;

  void allocate(int64_t bytes) {
    current += bytes;
    peak = std::max(peak, current);
  }
  // Memory needed for a moment on top of what is held.
  void spike(int64_t bytes) { peak = std::max(peak, current + bytes); }
  void release(int64_t bytes) { current -= bytes; }

  // What layer i keeps run with grad: kept[i], and its input too where it
  // would let it go but a checkpoint holds it (i == held_input).
  int64_t kept(int64_t i, int64_t held_input) const {
    return c.kept[i] + (i == held_input && c.frees(i) ? c.x[i] : 0);
  }

  // `held_input`: the layer whose input a checkpoint holds (a recomputation's
  // first), or -1.
  void forward(const std::vector<Segment>& segments, int64_t held_input) {
    for (const auto& s : segments) {
      for (int64_t i = s.begin; i < s.end; ++i) {
        time += c.forward[i];
        if (!s.checkpointed) {
          const int64_t k = kept(i, held_input);
          allocate(k);
          spike(std::max<int64_t>(0, c.forward_extra(i) - (k - c.kept[i])));
        } else {
          allocate(c.x[i + 1]);  // the layer's output
          spike(c.forward_extra(i));
          if (i > s.begin) release(c.x[i]);  // its input, unless the saved segment input
        }
      }
    }
  }

  // Holds the gradient of the chain's output on entry and leaves that of its
  // input. With `keep`, the output's gradient stays held to the end: autograd
  // holds a checkpoint's output gradient while the segment is recomputed and
  // backpropagated.
  void backward(const std::vector<Segment>& segments, bool keep, int64_t held_input) {
    for (size_t j = segments.size(); j-- > 0;) {
      const auto& s = segments[j];
      const bool held = keep && j + 1 == segments.size();
      if (s.checkpointed) {
        release(c.x[s.end]);  // the output kept by the no-grad forward, consumed by now
        forward(s.inner, s.begin);
        backward(s.inner, /*keep=*/true, s.begin);
        if (!held) release(c.x[s.end]);  // the output's gradient
        continue;
      }
      for (int64_t i = s.end - 1; i >= s.begin; --i) {
        allocate(c.gradient_bytes(i));  // its parameters' gradients, kept to the end
        spike(c.backward_extra(i));     // the input's gradient and temporaries
        time += c.backward[i];
        release(kept(i, held_input));
        if (!(held && i == s.end - 1)) release(c.x[i + 1]);  // gradient of the output
        allocate(c.x[i]);  // gradient of the input
      }
    }
  }
};

// Memory in units, for the dynamic programme.
struct UnitCosts {
  std::vector<int64_t> x, kept, forward_extra, backward_extra;
  std::vector<int64_t> grads_from;  // n + 1: the gradients of layers i..n-1, held from layer i's backward on
  int64_t capacity = 0;  // the budget in units
  int64_t unit = 1;
};

UnitCosts to_units(const ChainCosts& c, int64_t budget, int64_t slots) {
  UnitCosts u;
  // Tensor sizes usually share a large factor (batch × width × 4): counting in
  // that factor is exact. Otherwise units of budget / slots, sizes rounded up.
  int64_t g = 0;
  for (auto v : c.x) g = std::gcd(g, v);
  for (auto v : c.kept) g = std::gcd(g, v);
  for (auto v : c.forward_overhead) g = std::gcd(g, v);
  for (auto v : c.backward_overhead) g = std::gcd(g, v);
  for (auto v : c.gradient) g = std::gcd(g, v);
  const int64_t coarse = std::max<int64_t>(1, (budget + slots - 1) / slots);
  u.unit = (g > 0 && budget / g <= 8 * slots) ? std::max(g, int64_t{1}) : coarse;
  auto up = [&](int64_t b) { return (b + u.unit - 1) / u.unit; };
  for (auto v : c.x) u.x.push_back(up(v));
  for (auto v : c.kept) u.kept.push_back(up(v));
  for (int64_t i = 0; i < c.size(); ++i) {
    u.forward_extra.push_back(up(c.forward_extra(i)));
    u.backward_extra.push_back(up(c.backward_extra(i)));
  }
  // Sums rounded up once, not per layer: exact in fine units, safe in coarse ones.
  u.grads_from.assign(c.x.size(), 0);
  int64_t sum = 0;
  for (int64_t i = c.size(); i-- > 0;) {
    sum += c.gradient_bytes(i);
    u.grads_from[static_cast<size_t>(i)] = up(sum);
  }
  u.capacity = budget / u.unit;
  return u;
}

// opt(s, t, m, keep): least time to run forward and backward of layers
// [s, t) with at most m units, given its input held outside and the gradient
// of x[t] counted inside (until the end when `keep`: a recomputation's output
// gradient is held by autograd throughout). choice: -1 infeasible, 0 the first
// layer plain, s' > s a checkpointed segment [s, s') then the rest. Parameter
// gradients depend on the layer alone (backward runs in reverse order): the
// forward of [s, t) runs beside those of layers t..n-1, layer s's backward
// beside those of s..n-1.
class Solver {
 public:
  Solver(const ChainCosts& costs, const UnitCosts& units)
      : c_(costs), u_(units), n_(costs.size()), width_(units.capacity + 1) {
    const size_t cells = 2 * static_cast<size_t>((n_ + 1) * (n_ + 2) / 2) * static_cast<size_t>(width_);
    time_.assign(cells, kInfinity);
    choice_.assign(cells, -1);
    prefix_forward_.assign(static_cast<size_t>(n_ + 1), 0.0);
    for (int64_t i = 0; i < n_; ++i) prefix_forward_[i + 1] = prefix_forward_[i] + c_.forward[i];
    solve();
  }

  double time(int64_t s, int64_t t, int64_t m, bool keep) const {
    return m < 0 ? kInfinity : time_[at(s, t, m, keep)];
  }

  std::vector<Segment> build(int64_t s, int64_t t, int64_t m, bool keep) const {
    std::vector<Segment> out;
    const int64_t held = keep ? u_.x[t] : 0;
    while (s < t) {
      const int32_t pick = choice_[at(s, t, m, keep)];
      TORCH_INTERNAL_ASSERT(pick >= 0, "solver: no choice recorded for a feasible state");
      if (pick == 0) {
        push_plain(out, s, s + 1);
        m -= u_.kept[s];
        s += 1;
        continue;
      }
      out.push_back(Segment{s, pick, true, build(s, pick, m - held, /*keep=*/true)});
      m -= u_.x[pick];
      s = pick;
    }
    return out;
  }

  // The least m for which [0, n) is feasible, or -1.
  int64_t least_units() const {
    for (int64_t m = 0; m < width_; ++m) {
      if (time(0, n_, m, true) < kInfinity) return m;
    }
    return -1;
  }

 private:
  size_t at(int64_t s, int64_t t, int64_t m, bool keep) const {
    // Pairs (s, t) with s <= t, row-major by s; then keep; then m.
    const int64_t pair = s * (n_ + 1) - s * (s - 1) / 2 + (t - s);
    return static_cast<size_t>((pair * 2 + (keep ? 1 : 0)) * width_ + m);
  }

  void solve() {
    const auto& x = u_.x;
    const auto& kept = u_.kept;
    const auto& fo = u_.forward_extra;
    const auto& bo = u_.backward_extra;
    const auto& grads = u_.grads_from;
    for (int64_t t = 0; t <= n_; ++t) {
      for (int keep = 0; keep < 2; ++keep) {
        for (int64_t m = x[t] + grads[t]; m < width_; ++m) time_[at(t, t, m, keep)] = 0.0;
      }
    }
    for (int64_t length = 1; length <= n_; ++length) {
      for (int64_t s = 0; s + length <= n_; ++s) {
        const int64_t t = s + length;
        for (int keep = 0; keep < 2; ++keep) {
          const int64_t held = keep ? x[t] : 0;
          for (int64_t m = 0; m < width_; ++m) {
            double best = kInfinity;
            int32_t pick = -1;
            // The first layer runs with grad and keeps its activations; its
            // backward holds them, its output's gradient and its input's.
            // Chains that end the whole chain (t == n) meet their output's
            // gradient only after the forward; recomputed ones hold it throughout.
            const int64_t grad_in_forward = (t == n_ ? 0 : x[t]) + grads[t];
            const int64_t forward_peak = grad_in_forward + kept[s] + fo[s];
            const int64_t backward_peak = kept[s] + x[s + 1] + bo[s] + (s + 1 < t ? held : 0) + grads[s];
            const int64_t after_backward = x[s] + held + grads[s];
            if (kept[s] <= m && forward_peak <= m && backward_peak <= m && after_backward <= m) {
              const double rest = time(s + 1, t, m - kept[s], keep);
              if (rest < kInfinity) {
                best = c_.forward[s] + c_.backward[s] + rest;
                pick = 0;
              }
            }
            // Layers [s, e) run without grad keeping x[e], and are recomputed
            // once the rest is done, while autograd holds x[e]'s gradient.
            if (c_.may_start_checkpoint(s)) {
              int64_t segment_peak = 0;
              for (int64_t e = s + 1; e < t; ++e) {
                const int64_t k = e - 1;
                segment_peak = std::max(segment_peak, (k > s ? x[k] : 0) + x[k + 1] + fo[k]);
                if (grad_in_forward + segment_peak > m) break;  // grows with e
                const double rest = time(e, t, m - x[e], keep);
                if (rest == kInfinity) continue;
                const double again = time(s, e, m - held, /*keep=*/true);
                if (again == kInfinity) continue;
                const double total = (prefix_forward_[e] - prefix_forward_[s]) + rest + again;
                if (total < best) {
                  best = total;
                  pick = static_cast<int32_t>(e);
                }
              }
            }
            time_[at(s, t, m, keep)] = best;
            choice_[at(s, t, m, keep)] = pick;
          }
        }
      }
    }
  }

  const ChainCosts& c_;
  const UnitCosts& u_;
  int64_t n_;
  int64_t width_;
  std::vector<double> time_;
  std::vector<int32_t> choice_;
  std::vector<double> prefix_forward_;
};


} // namespace

std::string Schedule::to_string() const {
  std::string out;
  append_text(segments, out);
  return out;
}

void Schedule::validate(int64_t n) const { validate_cover(segments, 0, n, "top level"); }

Schedule avoid_in_place_starts(const Schedule& schedule, const std::vector<bool>& in_place) {
  TORCH_CHECK(static_cast<int64_t>(in_place.size()) == schedule.num_layers(), "avoid_in_place_starts: ",
              in_place.size(), " in-place flags for a schedule of ", schedule.num_layers(),
              " layers; give one per layer");
  Schedule out;
  for (const auto& s : schedule.segments) {
    if (!s.checkpointed) {
      push_plain(out.segments, s.begin, s.end);
      continue;
    }
    int64_t begin = s.begin;
    while (begin < s.end && in_place[static_cast<size_t>(begin)]) ++begin;
    if (begin > s.begin) {
      if (!out.segments.empty() && out.segments.back().checkpointed) {
        auto& prev = out.segments.back();
        prev.end = begin;
        prev.inner = {Segment{prev.begin, begin, false, {}}};
      } else {
        push_plain(out.segments, s.begin, begin);
      }
    }
    if (begin < s.end) out.segments.push_back(checkpointed_plain(begin, s.end));
  }
  return out;
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "none") return ScheduleKind::kNone;
  if (name == "every") return ScheduleKind::kEvery;
  if (name == "uniform") return ScheduleKind::kUniform;
  if (name == "sqrt") return ScheduleKind::kSqrt;
  if (name == "optimal") return ScheduleKind::kOptimal;
  TORCH_CHECK(false, "unknown checkpoint schedule '", name,
              "': expected none, every, uniform, sqrt or optimal");
}

Schedule schedule_none(int64_t n) {
  check_layers(n);
  return Schedule{{Segment{0, n, false, {}}}};
}

Schedule schedule_every(int64_t n, int64_t k) {
  check_layers(n);
  TORCH_CHECK(k >= 1, "schedule 'every K layers' needs K >= 1, got ", k);
  Schedule s;
  for (int64_t begin = 0; begin < n; begin += k) {
    const int64_t end = std::min(n, begin + k);
    if (end < n) {
      s.segments.push_back(checkpointed_plain(begin, end));
    } else {
      push_plain(s.segments, begin, end);
    }
  }
  return s;
}

Schedule schedule_uniform(int64_t n, int64_t segments) {
  check_layers(n);
  TORCH_CHECK(segments >= 1, "uniform schedule needs at least 1 segment, got ", segments);
  const int64_t size = n / segments;
  Schedule s;
  int64_t end = 0;
  for (int64_t start = 0; start < size * (segments - 1); start += size) {
    end = start + size;
    s.segments.push_back(checkpointed_plain(start, end));
  }
  push_plain(s.segments, end, n);
  return s;
}

Schedule schedule_sqrt(int64_t n) {
  check_layers(n);
  return schedule_uniform(n, std::max<int64_t>(1, std::llround(std::sqrt(double(n)))));
}

void ChainCosts::validate() const {
  const auto n = kept.size();
  TORCH_CHECK(n >= 1, "chain costs need at least one layer");
  TORCH_CHECK(x.size() == n + 1 && forward.size() == n && backward.size() == n &&
                  in_place.size() == n,
              "chain costs: expected ", n + 1, " sizes x and ", n,
              " entries of kept, forward, backward and in_place; got ", x.size(), ", ",
              kept.size(), ", ", forward.size(), ", ", backward.size(), ", ", in_place.size());
  for (auto v : x) TORCH_CHECK(v >= 0, "chain costs: negative size ", v);
  for (auto v : kept) TORCH_CHECK(v >= 0, "chain costs: negative kept bytes ", v);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(forward[i] >= 0 && backward[i] >= 0, "chain costs: negative time at layer ", i);
  }
  TORCH_CHECK(forward_overhead.empty() || forward_overhead.size() == n,
              "chain costs: forward_overhead needs ", n, " entries or none, got ",
              forward_overhead.size());
  TORCH_CHECK(backward_overhead.empty() || backward_overhead.size() == n,
              "chain costs: backward_overhead needs ", n, " entries or none, got ",
              backward_overhead.size());
  TORCH_CHECK(gradient.empty() || gradient.size() == n, "chain costs: gradient needs ", n,
              " entries or none, got ", gradient.size());
  for (auto v : gradient) TORCH_CHECK(v >= 0, "chain costs: negative gradient bytes ", v);
  TORCH_CHECK(frees_input.empty() || frees_input.size() == n, "chain costs: frees_input needs ", n,
              " entries or none, got ", frees_input.size());
  TORCH_CHECK(frees_input.empty() || !frees_input[0], "chain costs: frees_input[0] must be false "
              "(the chain's input is held by its caller)");
  for (auto v : forward_overhead) TORCH_CHECK(v >= 0, "chain costs: negative overhead ", v);
  for (auto v : backward_overhead) TORCH_CHECK(v >= 0, "chain costs: negative overhead ", v);
}

ChainCosts costs_from_profile(const ChainProfile& profile) {
  ChainCosts c;
  for (const auto& l : profile.layers) {
    c.x.push_back(l.input_bytes);
    c.kept.push_back(l.kept_bytes);
    c.forward.push_back(l.forward_seconds);
    c.backward.push_back(l.backward_seconds);
    c.in_place.push_back(l.in_place);
    c.frees_input.push_back(l.frees_input && c.kept.size() > 1);
    c.forward_overhead.push_back(std::max<int64_t>(0, l.forward_peak_bytes - l.kept_bytes));
    c.backward_overhead.push_back(l.backward_overhead_bytes);
  }
  if (!profile.layers.empty()) c.x.push_back(profile.layers.back().output_bytes);
  return c;
}

ScheduleCost simulate(const Schedule& schedule, const ChainCosts& costs) {
  costs.validate();
  schedule.validate(costs.size());
  Simulation sim{costs};
  sim.forward(schedule.segments, -1);
  const int64_t forward_peak = sim.peak, held = sim.current;
  sim.peak = sim.current;
  sim.allocate(costs.x.back());  // the gradient of the chain's output, once the loss is back
  // The caller holds the chain's output (the logits) until backward is done:
  // as much as keeping its gradient.
  sim.backward(schedule.segments, /*keep=*/true, -1);
  return {sim.time, std::max(forward_peak, sim.peak), forward_peak, held, sim.peak};
}

Schedule schedule_least_memory(const ChainCosts& costs, const SolverOptions& options) {
  costs.validate();
  TORCH_CHECK(options.slots() >= 1, "solver slots must be at least 1, got ", options.slots());
  // A budget that fits the plain run: its units are fine enough for the least one.
  const int64_t plain = simulate(schedule_none(costs.size()), costs).peak_bytes;
  UnitCosts units = to_units(costs, plain, options.slots());
  // In coarse units each tensor is rounded up, so the plain schedule may need
  // more units than its exact peak holds (parameter gradients far larger than
  // the activations): search up to that much more. At most a few held tensors
  // per layer are live at once.
  units.capacity += 3 * costs.size() + 3;
  Solver solver(costs, units);
  const int64_t m = solver.least_units();
  TORCH_INTERNAL_ASSERT(m >= 0, "the plain schedule must be feasible at its own peak");
  return Schedule{solver.build(0, costs.size(), m, /*keep=*/true)};
}

int64_t min_budget(const ChainCosts& costs, const SolverOptions& options) {
  return simulate(schedule_least_memory(costs, options), costs).peak_bytes;
}

Schedule solve_optimal(const ChainCosts& costs, int64_t budget, const SolverOptions& options) {
  costs.validate();
  TORCH_CHECK(budget > 0, "the optimal schedule needs a positive activation budget, got ", budget);
  TORCH_CHECK(options.slots() >= 1, "solver slots must be at least 1, got ", options.slots());
  const int64_t n = costs.size();
  // Recomputation only adds time: when the plain run fits, it is optimal.
  if (simulate(schedule_none(n), costs).peak_bytes <= budget) return schedule_none(n);
  const UnitCosts units = to_units(costs, budget, options.slots());
  Solver solver(costs, units);
  if (solver.time(0, n, units.capacity, /*keep=*/true) == kInfinity) {
    const int64_t least = min_budget(costs, options);
    TORCH_CHECK(least > budget, "no checkpoint schedule fits an activation budget of ",
                format_bytes(budget), " when memory is counted in units of ",
                format_bytes(units.unit), ", though one needing ", least,
                " bytes exists: raise SolverOptions::slots above ", options.slots());
    TORCH_CHECK(false, "no checkpoint schedule fits an activation budget of ", format_bytes(budget),
                " (", budget, " bytes): the most frugal schedule needs ", format_bytes(least), " (",
                least, " bytes); raise the budget to at least that or lower the batch size");
  }
  return Schedule{solver.build(0, n, units.capacity, /*keep=*/true)};
}

} // namespace memfit
