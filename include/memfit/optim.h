#pragma once
/// \file optim.h
/// LibTorch's SGD, Adam and AdamW with a step that either completes or
/// changes nothing.
///
/// Each is a torch::optim optimizer (same options, parameter groups, state
/// and serialization, so it swaps in with one word and LR schedulers work)
/// whose step runs in two phases. The first makes everything the step
/// allocates: the state a parameter gets at its first step, one work buffer
/// per device and dtype as large as the largest parameter (two where weight
/// decay or Nesterov momentum need one more), and the step's scalars (host
/// memory). Only then does the second phase change parameters and state,
/// with in-place and `out=` operations that allocate nothing. So an
/// allocation that fails (an out-of-memory error under a budget) leaves every
/// parameter and every state tensor as they were, and the state made for the
/// step is dropped again. The operations are LibTorch's own, in its order:
/// results are bitwise LibTorch's optimizer's.
///
/// Sync points: none. Extra memory: the work buffers during the step (one
/// largest parameter, or two), where LibTorch's loop makes two or three
/// temporaries of each parameter in turn.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>

namespace memfit {
namespace optim {

/// torch::optim::SGD whose step completes or changes nothing (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
///   lin(torch::ones({3, 4})).sum().backward();
///   sgd.step();
/// \endcode
class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::Adam whose step completes or changes nothing (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
///   lin(torch::ones({3, 4})).sum().backward();
///   adam.step();
/// \endcode
class Adam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::AdamW whose step completes or changes nothing (see the file comment).
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::AdamW adamw(lin->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
///   lin(torch::ones({3, 4})).sum().backward();
///   adamw.step();
/// \endcode
class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  /// One step over every parameter with a gradient; throws before changing
  /// anything when an allocation fails.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// Whether `optimizer`'s step completes or changes nothing: memfit's SGD,
/// Adam and AdamW (and a ZeroRedundancyOptimizer over them are not: its
/// broadcast follows the step). The Trainer recovers from an out-of-memory
/// error inside such a step; inside another optimizer's it cannot.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters());
///   torch::optim::Adam plain(lin->parameters());
///   assert(memfit::optim::is_transactional(adam) && !memfit::optim::is_transactional(plain));
/// \endcode
bool is_transactional(const torch::optim::Optimizer& optimizer);

/// The LibTorch optimizer type whose state `optimizer` keeps, as checkpoints
/// name it: "torch::optim::Adam" for memfit::optim::Adam too (their state and
/// serialization are the same), else the type's own name.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::Adam adam(lin->parameters());
///   assert(memfit::optim::state_type_name(adam) == "torch::optim::Adam");
/// \endcode
std::string state_type_name(const torch::optim::Optimizer& optimizer);

/// While alive, the steps of memfit's optimizers on this thread call `fn`
/// between their two phases: after everything the step allocates is made,
/// before any parameter or state changes.
///
/// If `fn` throws, the step changes nothing (the state it made is dropped)
/// and the exception propagates. The Trainer uses it to have the ranks of a
/// process group agree that each of them can step, before any of them does.
/// Guards nest; the innermost is called. Sync points: `fn`'s.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);
///   memfit::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1));
///   lin(torch::ones({3, 4})).sum().backward();
///   int calls = 0;
///   {
///     memfit::optim::BeforeCommit gate([&] { ++calls; });
///     sgd.step();
///   }
///   assert(calls == 1);
/// \endcode
class BeforeCommit {
 public:
  explicit BeforeCommit(std::function<void()> fn);
  ~BeforeCommit();
  BeforeCommit(const BeforeCommit&) = delete;
  BeforeCommit& operator=(const BeforeCommit&) = delete;

 private:
  std::function<void()> fn_;
  BeforeCommit* previous_;
  friend void before_commit();
};

/// Calls the innermost BeforeCommit's function on this thread, if any (what
/// memfit's optimizers call between their phases).
///
/// Example:
/// \code
///   memfit::optim::before_commit();  // no guard: nothing happens
/// \endcode
void before_commit();

/// Bytes of the state that `optimizer`'s next step will create: for SGD
/// (with momentum), Adam and AdamW, LibTorch's or memfit's, the state of each
/// parameter that has none yet (a momentum buffer; two moments, three with
/// amsgrad); 0 for other optimizers, whose state memfit does not know.
///
/// Example:
/// \code
///   auto lin = torch::nn::Linear(4, 2);  // 10 parameters
///   memfit::optim::Adam adam(lin->parameters());
///   assert(memfit::optim::lazy_state_bytes(adam) == 2 * 10 * 4);
/// \endcode
int64_t lazy_state_bytes(const torch::optim::Optimizer& optimizer);

} // namespace optim
} // namespace memfit
