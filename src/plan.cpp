#include "memfit/plan.h"

#include "memfit/module_plan.h"

#include "plan_wire.h"
#include "plan_choice.h"

#include "compat.h"

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <istream>
#include <limits>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>

namespace memfit {

TrainerOptions trainer_options(const StepSettings& s, TrainerOptions base) {
  return base.micro_batch_size(s.micro_batch())
      .precision(s.precision())
      .offload_optimizer(s.offload_optimizer())
      .offload_gradients(s.offload_gradients())
      .offload_parameters(s.offload_parameters())
      .stream(StreamOptions().tile_bytes(s.tile_bytes()));
}

std::string offload_text(const StepSettings& s) {
  if (s.offload_optimizer() != Offload::kHost) return "none";
  if (s.offload_parameters() == Offload::kHost) return "optimizer, gradients, parameters";
  return s.offload_gradients() == Offload::kHost ? "optimizer, gradients" : "optimizer";
}

// ---------------------------------------------------------------------------
// Broadcasting a plan

namespace {
nlohmann::json segments_wire(const std::vector<Segment>& segments) {
  auto j = nlohmann::json::array();
  for (const auto& s : segments) j.push_back({s.begin, s.end, s.checkpointed, segments_wire(s.inner)});
  return j;
}

// Field `name` of object `j` as a T, naming the field when it is missing or
// of another type.
template <class T>
T field(const nlohmann::json& j, const char* name) {
  TORCH_CHECK(j.is_object() && j.contains(name), "\"", name, "\" is missing");
  try {
    return j.at(name).get<T>();
  } catch (const nlohmann::json::exception&) {
    TORCH_CHECK(false, "\"", name, "\" is ", j.at(name).type_name(), ", not a ",
                std::is_same<T, bool>::value ? "boolean" : std::is_same<T, std::string>::value ? "string" :
                std::is_arithmetic<T>::value ? "number" : "list of strings");
  }
}

// Deeper schedules than this are refused (a chain's recomputation nests a
// level or two): a hand-edited file cannot make the reader recurse without end.
constexpr int kMaxScheduleDepth = 16;

// Segments in order, each [begin, end) non-empty and within [lo, hi), each
// starting where the previous ended; checked as they are read.
std::vector<Segment> segments_from_wire(const nlohmann::json& j, int depth = 0, int64_t lo = 0,
                                        int64_t hi = std::numeric_limits<int64_t>::max()) {
  TORCH_CHECK(depth < kMaxScheduleDepth, "\"schedule\" nests deeper than ", kMaxScheduleDepth, " levels");
  TORCH_CHECK(j.is_array(), "\"schedule\" must be an array of [begin, end, checkpointed, inner] segments");
  std::vector<Segment> out;
  int64_t next = lo;
  for (const auto& s : j) {
    TORCH_CHECK(s.is_array() && s.size() == 4, "a \"schedule\" segment must be [begin, end, checkpointed, inner], got ",
                s.dump().substr(0, 60));
    Segment seg{s.at(0).get<int64_t>(), s.at(1).get<int64_t>(), s.at(2).get<bool>(), {}};
    TORCH_CHECK(seg.begin == next && seg.end > seg.begin && seg.end <= hi, "a \"schedule\" segment [", seg.begin,
                ", ", seg.end, ") does not follow on from layer ", next, " within [", lo, ", ",
                hi == std::numeric_limits<int64_t>::max() ? std::string("...") : std::to_string(hi), ")");
    seg.inner = segments_from_wire(s.at(3), depth + 1, seg.begin, seg.end);
    TORCH_CHECK(seg.inner.empty() || seg.checkpointed, "a \"schedule\" segment [", seg.begin, ", ", seg.end,
                ") that is not checkpointed has inner segments");
    next = seg.end;
    out.push_back(std::move(seg));
  }
  return out;
}

// An enum stored as its number: one of `count` values.
template <class E>
E enum_from_wire(const nlohmann::json& j, const char* name, int count, const char* names) {
  const int v = field<int>(j, name);
  TORCH_CHECK(v >= 0 && v < count, "\"", name, "\" is ", v, ", not one of 0 to ", count - 1, " (", names, ")");
  return static_cast<E>(v);
}

// A count or a size: a number >= 0.
int64_t non_negative(const nlohmann::json& j, const char* name) {
  const auto v = field<int64_t>(j, name);
  TORCH_CHECK(v >= 0, "\"", name, "\" is ", v, "; it must be >= 0");
  return v;
}

nlohmann::json settings_wire(const StepSettings& s) {
  return {{"micro_batch", s.micro_batch()},
          {"precision", static_cast<int>(s.precision())},
          {"offload_optimizer", static_cast<int>(s.offload_optimizer())},
          {"offload_gradients", static_cast<int>(s.offload_gradients())},
          {"offload_parameters", static_cast<int>(s.offload_parameters())},
          {"tile_bytes", s.tile_bytes()},
          {"selective_recompute", s.selective_recompute()}};
}

// Plans saved before a plan held its schedules only per chain also carry a
// "schedule" here, which is not read.
StepSettings settings_from_wire(const nlohmann::json& j) {
  TORCH_CHECK(j.is_object(), "\"settings\" must be an object");
  return StepSettings()
      .micro_batch(non_negative(j, "micro_batch"))
      .precision(enum_from_wire<Precision>(j, "precision", 3, "0 fp32, 1 bf16, 2 fp16"))
      .offload_optimizer(enum_from_wire<Offload>(j, "offload_optimizer", 2, "0 none, 1 host"))
      .offload_gradients(enum_from_wire<Offload>(j, "offload_gradients", 2, "0 none, 1 host"))
      .offload_parameters(enum_from_wire<Offload>(j, "offload_parameters", 2, "0 none, 1 host"))
      .tile_bytes(non_negative(j, "tile_bytes"))
      .selective_recompute(field<bool>(j, "selective_recompute"));
}

nlohmann::json prediction_wire(const StepPrediction& p) {
  const auto& m = p.memory;
  return {{"peak_bytes", p.peak_bytes},
          {"memory", {m.peak, m.parameters, m.gradients, m.optimizer_state, m.activations}},
          {"seconds", p.seconds},
          {"accumulation_steps", p.accumulation_steps},
          {"phase", p.phase},
          {"forward_backward_bytes", p.forward_backward_bytes},
          {"activation_bytes", p.activation_bytes},
          {"optimizer_step_bytes", p.optimizer_step_bytes}};
}

StepPrediction prediction_from_wire(const nlohmann::json& j) {
  StepPrediction p;
  p.peak_bytes = field<int64_t>(j, "peak_bytes");
  const auto& m = j.at("memory");
  p.memory = {m.at(0).get<int64_t>(), m.at(1).get<int64_t>(), m.at(2).get<int64_t>(), m.at(3).get<int64_t>(),
              m.at(4).get<int64_t>()};
  p.seconds = field<double>(j, "seconds");
  p.accumulation_steps = field<int64_t>(j, "accumulation_steps");
  p.phase = field<std::string>(j, "phase");
  p.forward_backward_bytes = field<int64_t>(j, "forward_backward_bytes");
  p.activation_bytes = field<int64_t>(j, "activation_bytes");
  p.optimizer_step_bytes = field<int64_t>(j, "optimizer_step_bytes");
  return p;
}
} // namespace

namespace detail {

nlohmann::json parse_json(std::istream& in, int max_depth) {
  // The parser keeps its own stack; the callback stops a file nested deeper
  // than any memfit writes before the readers (which recurse) see it.
  return nlohmann::json::parse(in, [max_depth](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    TORCH_CHECK(depth <= max_depth, "it nests deeper than ", max_depth, " levels");
    return true;
  });
}

nlohmann::json schedules_wire(const std::vector<Schedule>& schedules) {
  auto j = nlohmann::json::array();
  for (const auto& s : schedules) j.push_back(segments_wire(s.segments));
  return j;
}

std::vector<Schedule> schedules_from_wire(const nlohmann::json& wire) {
  TORCH_CHECK(wire.is_array(), "\"schedules\" must be an array of schedules");
  std::vector<Schedule> out;
  for (const auto& s : wire) out.push_back(Schedule{segments_from_wire(s)});
  return out;
}

nlohmann::json plan_wire(const ModulePlan& plan) {
  auto timed = nlohmann::json::array();
  for (const auto& t : plan.timed) {
    timed.push_back({{"settings", settings_wire(t.settings)},
                     {"schedules", schedules_wire(t.schedules)},
                     {"predicted_seconds", t.predicted_seconds},
                     {"measured_seconds", t.measured_seconds},
                     {"measured_peak_bytes", t.measured_peak_bytes}});
  }
  nlohmann::json j = {{"fits", plan.fits},
                      {"budget", plan.budget},
                      {"batch", plan.batch},
                      {"settings", settings_wire(plan.settings)},
                      {"chains", plan.chains},
                      {"schedules", schedules_wire(plan.schedules)},
                      {"predicted", prediction_wire(plan.predicted)},
                      {"plain_seconds", plan.plain_seconds},
                      {"plain_peak_bytes", plan.plain_peak_bytes},
                      {"candidates", plan.candidates},
                      {"timed", timed},
                      {"measured_seconds", plan.measured_seconds},
                      {"step_seconds", plan.step_seconds},
                      {"measured_peak_bytes", plan.measured_peak_bytes},
                      {"measured_tie", plan.measured_tie},
                      {"why", plan.why}};
  if (!plan.model.empty()) j["model"] = plan.model;
  if (!plan.optimizer.empty()) j["optimizer"] = plan.optimizer;
  return j;
}

void plan_from_wire(const nlohmann::json& j, ModulePlan& plan) {
  plan.fits = field<bool>(j, "fits");
  plan.budget = non_negative(j, "budget");
  plan.batch = non_negative(j, "batch");
  plan.settings = settings_from_wire(j.at("settings"));
  plan.chains = field<std::vector<std::string>>(j, "chains");
  plan.schedules = schedules_from_wire(j.at("schedules"));
  TORCH_CHECK(plan.chains.size() == plan.schedules.size(), plan.chains.size(), " chain(s) but ",
              plan.schedules.size(), " schedule(s)");
  plan.predicted = prediction_from_wire(j.at("predicted"));
  plan.plain_seconds = field<double>(j, "plain_seconds");
  plan.plain_peak_bytes = field<int64_t>(j, "plain_peak_bytes");
  plan.candidates = non_negative(j, "candidates");
  plan.timed.clear();
  for (const auto& t : j.at("timed")) {
    TimedCandidate c;
    c.settings = settings_from_wire(t.at("settings"));
    c.schedules = schedules_from_wire(t.at("schedules"));
    c.predicted_seconds = field<double>(t, "predicted_seconds");
    c.measured_seconds = field<double>(t, "measured_seconds");
    c.measured_peak_bytes = field<int64_t>(t, "measured_peak_bytes");
    plan.timed.push_back(std::move(c));
  }
  plan.measured_seconds = field<double>(j, "measured_seconds");
  // Plans saved before step_seconds was recorded tell their timed steps' time only.
  plan.step_seconds = j.contains("step_seconds") ? field<double>(j, "step_seconds") : plan.measured_seconds;
  plan.measured_peak_bytes = field<int64_t>(j, "measured_peak_bytes");
  plan.measured_tie = field<double>(j, "measured_tie");
  plan.why = field<std::vector<std::string>>(j, "why");
  plan.model = j.contains("model") ? field<std::string>(j, "model") : std::string();
  plan.optimizer = j.contains("optimizer") ? field<std::string>(j, "optimizer") : std::string();
}

} // namespace detail

void broadcast_plan(ModulePlan& plan, ProcessGroup& group, int64_t root) {
  TORCH_CHECK(root >= 0 && root < group.size(), "broadcast_plan: root ", root, " is not a rank of the group of ",
              group.size(), "; use 0 to ", group.size() - 1);
  const bool mine = group.rank() == root;
  const auto text = detail::broadcast_text(group, mine ? detail::plan_wire(plan).dump() : std::string(), root);
  if (!mine) detail::plan_from_wire(nlohmann::json::parse(text), plan);
  const auto line = fmt::format("rank {}'s plan, broadcast to all {} ranks (broadcast_plan): every rank trains "
                                "with it, whatever its own timings said", root, group.size());
  // Once: a plan loaded from a saved run's (save_plan) may say it already.
  if (group.size() > 1 && std::find(plan.why.begin(), plan.why.end(), line) == plan.why.end()) {
    plan.why.push_back(line);
  }
}

} // namespace memfit
