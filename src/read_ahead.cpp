#include "read_ahead.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace memfit {
namespace detail {

ReadAhead::ReadAhead(size_t depth) : depth_(std::max<size_t>(depth, 1)) {
  // The reading thread runs LibTorch's operations on one thread of its own:
  // beside a step whose OpenMP threads fill the cores, a team of its own
  // would slow the step down (bench/trainer_bench.cpp's prefetch). ATen's
  // set_num_threads sets the calling thread's count and the process's
  // default for threads yet to start; the default is put back once the
  // reading thread has its one, while the caller waits here.
  const int threads = at::get_num_threads();
  thread_ = std::thread([this] { work(); });
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [this] { return started_; });
  }
  at::set_num_threads(threads);
}

ReadAhead::~ReadAhead() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

bool ReadAhead::has_room() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return jobs_.size() < depth_;
}

void ReadAhead::push(std::vector<size_t> indices, Read read) {
  auto job = std::make_shared<Job>();
  job->indices = std::move(indices);
  job->task = std::packaged_task<std::shared_ptr<void>()>(std::move(read));
  job->batch = job->task.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(jobs_.size() < depth_, "ReadAhead::push beyond its depth of ", depth_);
    jobs_.push_back(std::move(job));
  }
  wake_.notify_all();
}

std::shared_ptr<void> ReadAhead::pop(const std::vector<size_t>& indices) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(!jobs_.empty(), "ReadAhead::pop with nothing queued");
    job = jobs_.front();
  }
  // The read runs to its end even when it throws, so the job is done after get().
  auto done = [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.pop_front();
    --next_;
  };
  std::shared_ptr<void> batch;
  try {
    batch = job->batch.get();
  } catch (...) {
    done();
    throw;
  }
  done();
  TORCH_INTERNAL_ASSERT(job->indices == indices, "the batch read ahead is not the step's");
  return batch;
}

void ReadAhead::work() {
  at::get_num_threads();  // first ATen's own first-use set-up of this thread's count, then one
  at::set_num_threads(1);
  std::unique_lock<std::mutex> lock(mutex_);
  started_ = true;
  wake_.notify_all();
  while (true) {
    wake_.wait(lock, [this] { return stop_ || next_ < jobs_.size(); });
    if (stop_) return;
    auto job = jobs_[next_++];
    lock.unlock();
    job->task();  // its error goes to its future
    lock.lock();
  }
}

} // namespace detail
} // namespace memfit
