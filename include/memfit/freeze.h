#pragma once
/// \file freeze.h
/// Freezing: stop training parameters chosen by name, and release what their
/// training held (gradients, optimizer state).
///
/// Names are those of `Module::named_parameters()` ("0.weight",
/// "stage1_block0.conv1.weight"); patterns are shell globs matched against the
/// whole name (`*` and `?` also match dots): "0.*", "*.bn?.*", "head.bias".
///
/// Thread safety: not thread-safe (changes the module and optimizer). Sync
/// points: none. Extra memory: none; freezing frees each frozen parameter's
/// gradient and optimizer state.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memfit {

/// The names of `module`'s parameters that match the glob `pattern`.
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
///   auto names = memfit::match_parameters(*net, "fc0.*");  // {"fc0.weight", "fc0.bias"}
/// \endcode
std::vector<std::string> match_parameters(const torch::nn::Module& module,
                                          const std::string& pattern);

/// Freezes the parameters of `module` whose names match `pattern`: sets
/// requires_grad to false, releases their gradients and, when `optimizer` is
/// given, drops their optimizer state (they stay in its parameter groups and
/// are skipped, having no gradient). Returns the number of parameters frozen.
///
/// Throws c10::Error, changing nothing, when the pattern matches no
/// parameter (the message lists the first names there are).
///
/// Example:
/// \code
///   auto net = memfit::make_mlp(memfit::ModelOptions().width(8).depth(1));
///   torch::optim::Adam adam(net->parameters());
///   memfit::freeze(*net, "fc0.*", &adam);  // 2 parameters frozen
///   memfit::unfreeze(*net, "fc0.*", &adam);
/// \endcode
int64_t freeze(torch::nn::Module& module, const std::string& pattern,
               torch::optim::Optimizer* optimizer = nullptr);

/// Unfreezes the parameters whose names match `pattern` (requires_grad true).
/// With `optimizer`, those not in any of its parameter groups are added in a
/// new group with the optimizer's defaults (as Python's add_param_group).
/// Returns the number of parameters unfrozen; throws like freeze().
int64_t unfreeze(torch::nn::Module& module, const std::string& pattern,
                 torch::optim::Optimizer* optimizer = nullptr);

} // namespace memfit
