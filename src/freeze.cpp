#include "memfit/freeze.h"

#include "compat.h"

#include <c10/util/Exception.h>

#include <fnmatch.h>

#include <algorithm>
#include <sstream>

namespace memfit {
namespace {

std::vector<torch::Tensor> matching(const torch::nn::Module& module, const std::string& pattern) {
  TORCH_CHECK(!pattern.empty(), "empty parameter pattern: give a glob such as '0.*' or '*.weight'");
  std::vector<torch::Tensor> out;
  std::ostringstream names;
  int64_t shown = 0;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (::fnmatch(pattern.c_str(), item.key().c_str(), 0) == 0) out.push_back(item.value());
    if (shown < 6) names << (shown++ ? ", " : "") << item.key();
  }
  TORCH_CHECK(!out.empty(), "parameter pattern '", pattern,
              "' matches no parameter name; names look like: ", names.str(),
              (module.named_parameters().size() > 6 ? ", ..." : ""),
              " (a glob: '*' and '?' also match dots)");
  return out;
}

bool in_optimizer(const torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& q : group.params()) {
      if (q.is_same(p)) return true;
    }
  }
  return false;
}

} // namespace

std::vector<std::string> match_parameters(const torch::nn::Module& module,
                                          const std::string& pattern) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (::fnmatch(pattern.c_str(), item.key().c_str(), 0) == 0) names.push_back(item.key());
  }
  return names;
}

int64_t freeze(torch::nn::Module& module, const std::string& pattern,
               torch::optim::Optimizer* optimizer) {
  auto params = matching(module, pattern);
  for (auto& p : params) {
    p.set_requires_grad(false);
    p.mutable_grad() = torch::Tensor();
    if (optimizer) optimizer->state().erase(compat::optimizer_state_key(p));
  }
  return static_cast<int64_t>(params.size());
}

int64_t unfreeze(torch::nn::Module& module, const std::string& pattern,
                 torch::optim::Optimizer* optimizer) {
  auto params = matching(module, pattern);
  std::vector<torch::Tensor> added;
  for (auto& p : params) {
    p.set_requires_grad(true);
    if (optimizer && !in_optimizer(*optimizer, p)) added.push_back(p);
  }
  if (!added.empty()) {
    optimizer->add_param_group(torch::optim::OptimizerParamGroup(added));  // the defaults
  }
  return static_cast<int64_t>(params.size());
}

} // namespace memfit
