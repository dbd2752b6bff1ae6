#include "report.h"
#include "usage.h"

#include "memfit/environment.h"
#include "memfit/state.h"

#include <fmt/format.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <nlohmann/json.hpp>

#include <c10/util/Exception.h>

namespace memfit {
namespace tools {
namespace {

// Text safe inside HTML.
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// The drawing script: three SVG charts from the embedded run; it marks the
// body with data-charts-drawn="N" when done.
constexpr const char* kScript = R"JS(
(function () {
  const run = JSON.parse(document.getElementById('run').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const MiB = 1048576;
  const colors = {parameters: '#4c78a8', gradients: '#f58518', optimizer_state: '#54a24b', activations: '#e45756'};
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function svg(id, w, h) {
    const s = el('svg', {width: w, height: h, viewBox: '0 0 ' + w + ' ' + h, role: 'img'});
    document.getElementById(id).appendChild(s);
    return s;
  }
  function text(s, x, y, t, anchor) {
    const e = el('text', {x: x, y: y, 'font-size': 11, 'text-anchor': anchor || 'start'}, s);
    e.textContent = t;
    return e;
  }
  function hline(s, y, x0, x1, color, label) {
    el('line', {x1: x0, x2: x1, y1: y, y2: y, stroke: color, 'stroke-dasharray': '4 3'}, s);
    text(s, x1, y - 3, label, 'end');
  }
  let drawn = 0;
  const summary = run.summary || {};
  const budget = run.plan ? run.plan.budget_bytes : 0;
  const predicted = summary.predicted_peak_bytes || 0;

  // 1. The largest step, phase by phase, stacked by category.
  const tl = run.step_timeline || [];
  if (tl.length > 0) {
    const W = 760, H = 300, L = 60, B = 60, T = 20;
    const s = svg('timeline', W, H);
    const top = Math.max(...tl.map(p => p.peak_bytes), budget, predicted) * 1.05;
    const y = v => T + (H - T - B) * (1 - v / top);
    const bw = (W - L - 20) / tl.length;
    tl.forEach((p, i) => {
      let base = 0;
      for (const c of ['parameters', 'gradients', 'optimizer_state', 'activations']) {
        const v = p[c];
        el('rect', {x: L + i * bw + 4, width: bw - 8, y: y(base + v), height: Math.max(0, y(base) - y(base + v)),
                    fill: colors[c], 'data-category': c}, s);
        base += v;
      }
      const label = tl.length <= 8 ? p.phase
          : p.phase.replace('forward ', 'F').replace('backward ', 'B').replace('optimizer step', 'opt').replace('released', 'rel');
      text(s, L + i * bw + bw / 2, H - B + 14, label, 'middle');
    });
    for (let k = 0; k <= 4; ++k) text(s, L - 6, y(top * k / 4) + 4, (top * k / 4 / MiB).toFixed(1) + ' MiB', 'end');
    if (budget > 0) hline(s, y(budget), L, W - 10, '#000', 'budget ' + (budget / MiB).toFixed(2) + ' MiB');
    if (predicted > 0) hline(s, y(predicted), L, W - 10, '#9467bd', 'predicted peak ' + (predicted / MiB).toFixed(2) + ' MiB');
    let lx = L;
    for (const c in colors) {
      el('rect', {x: lx, y: H - 22, width: 10, height: 10, fill: colors[c]}, s);
      text(s, lx + 14, H - 13, c.replace('_', ' '));
      lx += 130;
    }
    ++drawn;
  }

  // 2. Peak memory of every step, with the plan's prediction and the budget.
  // 3. The loss curve.
  const steps = run.steps || [];
  function series(id, values, label, lines) {
    const W = 760, H = 220, L = 60, B = 30, T = 14;
    const s = svg(id, W, H);
    // A NaN or infinite loss is written as null: no point for it.
    const finite = values.filter(v => typeof v === 'number' && isFinite(v));
    const hi = Math.max(...finite, ...lines.map(l => l.v)) * 1.05 || 1;
    const x = i => L + (W - L - 20) * (values.length > 1 ? i / (values.length - 1) : 0.5);
    const y = v => T + (H - T - B) * (1 - v / hi);
    const points = [];
    values.forEach((v, i) => { if (typeof v === 'number' && isFinite(v)) points.push(x(i) + ',' + y(v)); });
    el('polyline', {points: points.join(' '), fill: 'none', stroke: '#4c78a8', 'stroke-width': 1.5}, s);
    for (const l of lines) if (l.v > 0) hline(s, y(l.v), L, W - 10, l.color, l.label);
    text(s, L - 6, y(hi / 1.05) + 4, label(hi / 1.05), 'end');
    text(s, L - 6, y(0) + 4, label(0), 'end');
    text(s, (W + L) / 2, H - 6, 'step', 'middle');
    ++drawn;
  }
  if (steps.length > 0) {
    series('peaks', steps.map(s => s.peak_bytes), v => (v / MiB).toFixed(1) + ' MiB',
           [{v: budget, color: '#000', label: 'budget'}, {v: predicted, color: '#9467bd', label: 'predicted peak'}]);
    series('loss', steps.map(s => s.loss), v => v.toFixed(2), []);
  }
  document.body.setAttribute('data-charts-drawn', String(drawn));
})();
)JS";

} // namespace

namespace {
// Refused in a line unless `v` is a number or null (how a report writes a NaN
// or infinite value: JSON has none); `where()` names it, only on failure.
template <typename Where>
void check_number(const nlohmann::json& v, const Where& where) {
  TORCH_CHECK(v.is_number() || v.is_null(), "not a memfit run report (", where(), " is ", v.type_name(),
              ", not a number); write one with memfit train --report FILE.json");
}

// Each entry of `list` (where the report has it) an object whose `keys`,
// where present, are numbers or null; refused in a line otherwise.
void check_entries(const nlohmann::json& run, const char* list, std::initializer_list<const char*> keys) {
  if (!run.contains(list)) return;
  const auto& entries = run[list];
  TORCH_CHECK(entries.is_array(), "not a memfit run report (\"", list, "\" is ", entries.type_name(),
              ", not a list); write one with memfit train --report FILE.json");
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    TORCH_CHECK(e.is_object(), "not a memfit run report (\"", list, "\" entry ", i, " is ", e.type_name(),
                ", not an object); write one with memfit train --report FILE.json");
    for (const char* key : keys) {
      if (e.contains(key)) check_number(e[key], [&] { return fmt::format("\"{}\" entry {}: \"{}\"", list, i, key); });
    }
  }
}

// The report's JSON, refused in a line where it is not a memfit run report.
nlohmann::json parse_report(const std::string& json_text) {
  nlohmann::json run;
  try {
    run = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, "not a memfit run report (not JSON at byte ", e.byte,
                "); write one with memfit train --report FILE.json");
  }
  TORCH_CHECK(run.is_object() && run.contains("steps") && run.contains("summary"),
              "not a memfit run report (no \"steps\" and \"summary\"); write one with memfit "
              "train --report FILE.json");
  TORCH_CHECK(run["steps"].is_array() && run["summary"].is_object(), "not a memfit run report (\"steps\" must be "
              "a list and \"summary\" an object); write one with memfit train --report FILE.json");
  // What the charts draw: each step's and each phase's figures (null: a NaN or infinite value).
  check_entries(run, "steps", {"step", "loss", "seconds", "peak_bytes"});
  check_entries(run, "step_timeline", {"peak_bytes", "parameters", "gradients", "optimizer_state", "activations"});
  return run;
}

std::string mib(int64_t b) { return fmt::format("{:.2f} MiB", double(b) / (1 << 20)); }

// The table of facts: the summary's figures, recoveries and the environment.
std::string facts_html(const nlohmann::json& run) {
  const auto& sum = run["summary"];
  // A summary number, as text: null is a NaN or infinite value (JSON has none).
  auto number = [&sum](const char* key, const std::function<std::string(double)>& show) -> std::string {
    const auto& v = sum[key];
    check_number(v, [key] { return fmt::format("summary \"{}\"", key); });
    return v.is_null() ? "NaN or infinite" : show(v.get<double>());
  };
  std::string facts;
  auto fact = [&](const std::string& k, const std::string& v) {
    facts += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", escape(k), escape(v));
  };
  fact("steps", std::to_string(run["steps"].size()));
  if (sum.contains("final_loss")) fact("final loss", number("final_loss", [](double v) { return fmt::format("{:.4f}", v); }));
  if (sum.contains("test_accuracy")) {
    fact("test accuracy", number("test_accuracy", [](double v) { return fmt::format("{:.2f}%", 100 * v); }));
  }
  if (sum.contains("peak_bytes")) fact("measured peak", number("peak_bytes", [](double v) { return mib(int64_t(v)); }));
  if (sum.contains("predicted_peak_bytes")) {
    fact("predicted peak (plan)", number("predicted_peak_bytes", [](double v) { return mib(int64_t(v)); }));
  }
  if (sum.contains("samples_per_second")) {
    fact("speed", number("samples_per_second", [](double v) { return fmt::format("{:.0f} samples/s", v); }));
  }
  if (sum.contains("precision") && sum["precision"].is_string()) fact("precision", sum["precision"].get<std::string>());
  if (run.contains("recoveries") && run["recoveries"].is_array()) {
    for (const auto& r : run["recoveries"]) {  // steps that ran out of memory and were re-planned
      if (!r.is_object()) continue;
      fact(fmt::format("out of memory at step {}", r.value("step", int64_t(0))),
           fmt::format("{} → {}", r.value("before", std::string()),
                       r.value("after", std::string()).empty() ? "gave up" : r.value("after", std::string())));
    }
  }
  if (run.contains("environment")) {
    const auto& env = run["environment"];
    fact("LibTorch", fmt::format("{}, {}, {} threads", env.value("libtorch", std::string()),
                                 env.value("cuda", false) ? "CUDA" : "CPU only", env.value("threads", 0)));
    if (env.contains("blas")) {
      const auto& blas = env["blas"];
      const auto library = blas.value("library", std::string());
      fact("BLAS", blas.value("name", std::string()) + (library.empty() ? "" : " (" + library + ")"));
    }
  }
  return facts;
}

// The plan's knobs and its reasons.
std::string plan_html(const nlohmann::json& run) {
  std::string plan = "<p>No plan: the run had no budget, or its knobs were set by hand.</p>";
  if (run.contains("plan")) {
    const auto& p = run["plan"];
    plan = fmt::format(
        "<p>Budget {}; micro-batch {} ({} per batch of {}); precision {}; checkpoint {}; "
        "offload {}.</p>\n<ul>\n",
        mib(p.value("budget_bytes", int64_t(0))), p.value("micro_batch", int64_t(0)),
        p.value("accumulation_steps", int64_t(1)), p.value("batch", int64_t(0)),
        escape(p.value("precision", std::string())), escape(p.value("checkpoint", std::string())),
        escape(p.value("offload", std::string())));
    for (const auto& w : p.value("why", nlohmann::json::array())) {
      if (w.is_string()) plan += "<li>" + escape(w.get<std::string>()) + "</li>\n";
    }
    plan += "</ul>\n";
  }
  return plan;
}

std::string render(const std::string& json_text, const std::string& title) {
  const auto run = parse_report(json_text);
  const std::string facts = facts_html(run), plan = plan_html(run);
  std::string data = run.dump();
  // No "<" in the script element: "</script>" or "<!--" in a string would end or change it.
  for (size_t at = data.find('<'); at != std::string::npos; at = data.find('<', at + 6)) {
    data.replace(at, 1, "\\u003c");
  }
  return fmt::format(R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 820px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 2px 12px 2px 0; }}
svg {{ background: #fafafa; border: 1px solid #ddd; }}
</style></head>
<body>
<h1>{title}</h1>
<table>
{facts}</table>
<h2>The largest step, phase by phase (F/B: forward/backward of micro-batch k)</h2>
<div id="timeline"></div>
<h2>Peak memory of each step</h2>
<div id="peaks"></div>
<h2>Loss</h2>
<div id="loss"></div>
<h2>The plan</h2>
{plan}
<script type="application/json" id="run">{data}</script>
<script>{script}</script>
</body></html>
)HTML",
                     fmt::arg("title", escape(title)), fmt::arg("facts", facts),
                     fmt::arg("plan", plan), fmt::arg("data", data), fmt::arg("script", kScript));
}
} // namespace

std::string report_html(const std::string& json_text, const std::string& title) {
  try {
    return render(json_text, title);
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    const auto close = what.find("] ");
    TORCH_CHECK(false, "not a memfit run report (", close == std::string::npos ? what : what.substr(close + 2),
                "); write one with memfit train --report FILE.json");
  }
}

void add_report_command(CLI::App& app, ReportArgs& args) {
  auto* report = app.add_subcommand(
      "report", "Write one self-contained HTML page from a `memfit train --report` JSON: the "
                "memory timeline of the largest step by category, each step's peak against the "
                "plan and the budget, the loss curve and the plan");
  report->add_option("run", args.run, "The run's JSON report")->required()->check(CLI::ExistingFile);
  report->add_option("-o,--output", args.output, "The HTML file to write")
      ->required()
      ->check(memfit::tools::path("file"));
}

int run_report(const ReportArgs& args) {
  check_output("--output", args.output, {args.run});
  std::ifstream is(args.run);
  std::stringstream text;
  text << is.rdbuf();
  const std::string title = "memfit run " + std::filesystem::path(args.run).filename().string();
  // A file that is not a report memfit wrote is the caller's mistake: a usage error, before any output.
  const std::string html = as_usage([&] {
    try {
      return report_html(text.str(), title);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, args.run, ": ", e.msg());
    }
  });
  memfit::write_file_atomically(args.output, html);
  fmt::print("report written to {}\n", args.output);
  return 0;
}

void write_run_report(const std::string& path, const memfit::TrainReport& report,
                      const std::optional<memfit::ModulePlan>& plan) {
  auto json = nlohmann::json::parse(report.to_json());
  json["environment"] = nlohmann::json::parse(memfit::environment().to_json());
  if (plan) {
    json["plan"] = nlohmann::json::parse(plan->to_json());
    json["summary"]["predicted_peak_bytes"] = plan->predicted.peak_bytes;
  }
  memfit::write_file_atomically(path, json.dump(2) + "\n");
  fmt::print("report written to {}\n", path);
}

} // namespace tools
} // namespace memfit
