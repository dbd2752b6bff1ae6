#pragma once
// memfit report: one self-contained HTML page from a `memfit train --report` JSON.

#include <string>

namespace memfit {
namespace tools {

/// The HTML page for the run report `json_text`: the memory of the largest
/// step phase by phase and by category, the peak of every step with the
/// plan's prediction and the budget, the loss curve, and the plan's reasons.
/// No network access: styles, data and the drawing script are inline.
std::string report_html(const std::string& json_text, const std::string& title);

} // namespace tools
} // namespace memfit
