// libmemfit_tax.so: one model trained several ways in one process, for
// bench/tax.py: memfit's Trainer, a hand-written LibTorch loop, the Trainer
// on a TorchScript file of the model, and (from Python, on the same
// LibTorch) PyTorch's own loop. Python builds its model, hands this library
// its data and its initial parameters, and calls one step of each side in
// turn, so that all of them run the same kernels on the same threads and
// allocator, side by side.
//
//   lib = ctypes.CDLL("build/bench/libmemfit_tax.so")
//   lib.memfit_tax_setup(b"cnn", batch, micro, 0, 0, 0, 0, 0, b"", b"cpu", b"fp32", b"auto")   # 0: whole batches
//   lib.memfit_tax_set_data(...); lib.memfit_tax_set_parameter(i, ptr, numel) ...
//   loss = lib.memfit_tax_step(0, 1 or 2, step)   # the loop, the Trainer, the Trainer on TorchScript
//
// The models are memfit's make_resnet (width 16, 3 stages of 3 blocks,
// out-of-place ReLUs, as bench/peers.py's make_chain) and make_gpt; the
// optimizer is Adam (lr 1e-3) on every side; a step of `micro` examples at a
// time weights each micro-batch's loss by its share and reads it once.
// On a CUDA device the models, gradients and Adam's state are there; the
// data stays in host memory and each side copies its batch to the device
// inside its step (the loop the whole batch, the Trainer each micro-batch).
// Errors come back as a negative result (NaN for a step) and
// memfit_tax_error()'s text: nothing here throws across the C boundary.

#include "compat.h"
#include "memfit/memory.h"
#include "memfit/models.h"
#include "memfit/precision.h"
#include "memfit/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <utility>

namespace {

struct Tax {
  torch::Device device{torch::kCPU};
  int64_t batch = 0;
  int64_t micro = 0;
  memfit::Precision precision = memfit::Precision::kFP32;  // the forwards' autocast (bf16: every side alike)
  torch::Tensor inputs, targets;
  torch::nn::Sequential loop_model{nullptr};
  std::unique_ptr<torch::optim::Adam> loop_optimizer;
  torch::nn::Sequential trainer_model{nullptr};
  std::unique_ptr<memfit::Trainer> trainer;
  torch::nn::Sequential script_model{nullptr};  // the Trainer on load_torchscript's chain, when given a file
  std::unique_ptr<memfit::Trainer> script_trainer;
};

std::unique_ptr<Tax> tax;
// The meter's device: the models', once they are set up.
torch::Device meter_device() { return tax ? tax->device : torch::Device(torch::kCPU); }
// A Trainer step's own peak: on CUDA its per-phase meter resets the device's
// one peak statistic, so the meter read after the step would miss it.
int64_t trainer_peak = 0;
std::string last_error;

// Runs f, turning an exception into `failed` and last_error. LibTorch's
// warnings (the Trainer's about BatchNorm and micro-batches) are caught here
// and printed to stderr: the calling Python process's own warning handler
// must not run from a ctypes call, which holds no GIL.
template <class F>
auto guarded(F f, decltype(f()) failed) {
  memfit::compat::WarningCapture warnings;
  auto out = failed;
  try {
    out = f();
  } catch (const std::exception& e) {
    last_error = e.what();
  }
  for (const auto& m : warnings.messages) std::fprintf(stderr, "libmemfit_tax: warning: %s\n", m.c_str());
  return out;
}

torch::nn::Sequential make(const std::string& kind, int64_t vocab, int64_t width, int64_t depth, int64_t heads,
                           int64_t context) {
  if (kind == "cnn") return memfit::make_resnet(memfit::ModelOptions().depth(3).inplace(false));
  TORCH_CHECK(kind == "gpt", "memfit_tax_setup: unknown model '", kind, "': expected cnn or gpt");
  return memfit::make_gpt(
      memfit::ModelOptions().num_classes(vocab).width(width).depth(depth).heads(heads).context(context));
}

// The loss in fp32 outside autocast, as the Trainer and bench/peers.py take it.
torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& y) {
  const auto logits = out.to(torch::kFloat);
  if (logits.dim() > 2) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  }
  return torch::nn::functional::cross_entropy(logits, y);
}

// The hand-written loop: what a LibTorch user writes for accumulation.
double loop_step(Tax& t, const torch::Tensor& host_x, const torch::Tensor& host_y) {
  const auto x = host_x.to(t.device);
  const auto y = host_y.to(t.device);
  const int64_t m = t.micro > 0 ? t.micro : t.batch;
  double total = 0;
  for (int64_t start = 0; start < t.batch; start += m) {
    const int64_t len = std::min(m, t.batch - start);
    torch::Tensor out;
    {
      memfit::AutocastGuard autocast(t.device, t.precision);  // a user's at::autocast calls, scoped
      out = t.loop_model->forward(x.narrow(0, start, len));
    }
    auto loss = loss_of(std::exchange(out, torch::Tensor()), y.narrow(0, start, len));  // the output dies here
    if (len != t.batch) loss = loss * (double(len) / double(t.batch));
    total += loss.item<double>();
    loss.backward();
  }
  t.loop_optimizer->step();
  for (auto& p : t.loop_model->parameters()) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none)
  return total;
}

torch::Tensor from_python(void* data, torch::ScalarType dtype, const int64_t* shape, int64_t dims) {
  return torch::from_blob(data, torch::IntArrayRef(shape, size_t(dims)), torch::TensorOptions().dtype(dtype)).clone();
}

}  // namespace

extern "C" {

/// The text of the last failure.
const char* memfit_tax_error() { return last_error.c_str(); }

/// Builds the C++ sides (model "cnn" or "gpt"; the GPT's sizes from the
/// arguments; with `script` a TorchScript file of the same model, a third
/// side: the Trainer on load_torchscript's chain); micro 0 runs whole
/// batches; `device` is "cpu" or "cuda"; `precision` "fp32" or "bf16" (the
/// forwards under autocast); `kernel` the Trainers' optimizer kernel ("auto",
/// "loop" or "fused"; the hand-written loop keeps torch::optim::Adam).
/// Returns 0, or -1.
int memfit_tax_setup(const char* model, int64_t batch, int64_t micro, int64_t vocab, int64_t width, int64_t depth,
                     int64_t heads, int64_t context, const char* script, const char* device, const char* precision,
                     const char* kernel) {
  return guarded(
      [&] {
        auto t = std::make_unique<Tax>();
        t->device = torch::Device(device);
        t->batch = batch;
        t->micro = micro;
        t->precision = memfit::parse_precision(precision);
        TORCH_CHECK(t->precision != memfit::Precision::kFP16, "memfit_tax_setup: precision fp32 or bf16, got fp16");
        t->loop_model = make(model, vocab, width, depth, heads, context);
        t->loop_model->to(t->device);
        t->loop_optimizer = std::make_unique<torch::optim::Adam>(t->loop_model->parameters(),
                                                                 torch::optim::AdamOptions(1e-3));
        t->trainer_model = make(model, vocab, width, depth, heads, context);
        const auto options =
            memfit::TrainerOptions().batch_size(batch).micro_batch_size(micro).lr(1e-3).device(t->device).precision(
                t->precision).optimizer_kernel(memfit::optim::parse_kernel(kernel));
        t->trainer = std::make_unique<memfit::Trainer>(t->trainer_model, options);
        if (script != nullptr && *script != 0) {
          t->script_model = memfit::load_torchscript(script);
          t->script_trainer = std::make_unique<memfit::Trainer>(t->script_model, options);
        }
        tax = std::move(t);
        return 0;
      },
      -1);
}

/// The training data: inputs (float32, or int64 token ids when `ids`) and
/// int64 targets, copied. Returns 0, or -1.
int memfit_tax_set_data(void* inputs, int ids, const int64_t* shape, int64_t dims, void* targets,
                        const int64_t* target_shape, int64_t target_dims) {
  return guarded(
      [&] {
        TORCH_CHECK(tax, "memfit_tax_set_data before memfit_tax_setup");
        tax->inputs = from_python(inputs, ids ? torch::kLong : torch::kFloat, shape, dims);
        tax->targets = from_python(targets, torch::kLong, target_shape, target_dims);
        return 0;
      },
      -1);
}

/// How many parameters each C++ model has.
int64_t memfit_tax_parameter_count() { return tax ? int64_t(tax->loop_model->parameters().size()) : -1; }

/// Copies `numel` float32 values into parameter `i` of every C++ model (in
/// named_parameters order, as Python's). Returns 0, or -1 on a size mismatch.
int memfit_tax_set_parameter(int64_t i, const float* data, int64_t numel) {
  return guarded(
      [&] {
        TORCH_CHECK(tax, "memfit_tax_set_parameter before memfit_tax_setup");
        torch::NoGradGuard no_grad;
        for (const auto& model : {tax->loop_model, tax->trainer_model, tax->script_model}) {
          if (model.is_empty()) continue;
          auto p = model->parameters().at(size_t(i));
          TORCH_CHECK(p.numel() == numel, "parameter ", i, " has ", p.numel(), " values in C++, ", numel,
                      " in Python: the models differ");
          p.copy_(torch::from_blob(const_cast<float*>(data), p.sizes(), torch::kFloat));
        }
        return 0;
      },
      -1);
}

/// One optimizer step of side 0 (the loop), 1 (the Trainer) or 2 (the
/// Trainer on the TorchScript chain) on batch `step` of the data; returns
/// its loss, or NaN.
double memfit_tax_step(int side, int64_t step) {
  return guarded(
      [&] {
        TORCH_CHECK(tax && tax->inputs.defined(), "memfit_tax_step before memfit_tax_setup and memfit_tax_set_data");
        const int64_t n = tax->inputs.size(0) / tax->batch;
        const auto x = tax->inputs.narrow(0, (step % n) * tax->batch, tax->batch);
        const auto y = tax->targets.narrow(0, (step % n) * tax->batch, tax->batch);
        if (side == 0) return loop_step(*tax, x, y);
        auto& trainer = side == 1 ? tax->trainer : tax->script_trainer;
        TORCH_CHECK(trainer, "memfit_tax_step: no side ", side, " (side 2 needs a TorchScript file)");
        const auto rec = trainer->train_step(torch::data::Example<>(x, y));
        trainer_peak = rec.peak_bytes;
        return rec.loss;
      },
      std::numeric_limits<double>::quiet_NaN());
}

/// memfit's meter, as libmemfit_meter.so's (on CUDA, the caching
/// allocator's counters): bytes allocated now, the peak since the last
/// reset, and a reset.
int64_t memfit_tax_allocated() { return memfit::memory_allocated(meter_device()); }
int64_t memfit_tax_peak() { return std::max(memfit::max_memory_allocated(meter_device()), trainer_peak); }
void memfit_tax_reset_peak() {
  trainer_peak = 0;
  memfit::reset_peak_memory_stats(meter_device());
}

/// The optimizer kernel the Trainer's last step ran (memfit::optim::kernel_ran).
const char* memfit_tax_kernel_ran() {
  static std::string ran;
  ran = tax ? memfit::optim::kernel_ran(tax->trainer->optimizer()) : "none";
  return ran.c_str();
}

/// Frees both C++ sides.
void memfit_tax_teardown() { tax.reset(); }

}  // extern "C"
