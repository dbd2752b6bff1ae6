#pragma once
// The wire format of a plan: JSON that gives every field back exactly, which
// broadcast_plan and save_plan carry (plan.cpp).

#include "memfit/module_plan.h"

#include <nlohmann/json.hpp>

#include <istream>
#include <vector>

namespace memfit {
namespace detail {

// Chain schedules as JSON that gives them back exactly (what a ModulePlan
// adds to broadcast_plan's wire), and back.
nlohmann::json schedules_wire(const std::vector<Schedule>& schedules);
std::vector<Schedule> schedules_from_wire(const nlohmann::json& wire);
// Parses JSON from `in`, refusing (c10::Error) nesting deeper than `max_depth`.
nlohmann::json parse_json(std::istream& in, int max_depth = 32);
// A plan as JSON that gives every field back exactly (not ModulePlan::to_json,
// which reports; broadcast_plan and save_plan carry it), and back.
nlohmann::json plan_wire(const ModulePlan& plan);
void plan_from_wire(const nlohmann::json& j, ModulePlan& plan);

} // namespace detail
} // namespace memfit
