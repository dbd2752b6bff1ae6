#pragma once
// Reading a run's batches ahead of the step that uses them
// (TrainerOptions::prefetch_factor). Not installed.
//
// Thread safety: one thread calls push and pop; the reads run, one at a
// time and in order, on a thread of ReadAhead's own, whose LibTorch
// operations run single-threaded (at::set_num_threads(1) there). Sync points: pop waits
// for its batch's read. Extra memory: up to `depth` batches read and waiting.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace memfit {
namespace detail {

class ReadAhead {
 public:
  // Reads one batch; runs on the reading thread.
  using Read = std::function<std::shared_ptr<void>()>;

  // At most `depth` (at least 1) reads queued or waiting to be popped.
  explicit ReadAhead(size_t depth);
  // Waits for the read in progress, if any; the other queued reads never run.
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // Whether fewer than `depth` reads are queued or waiting to be popped.
  bool has_room() const;
  // Queues the read of the examples at `indices`.
  void push(std::vector<size_t> indices, Read read);
  // The oldest queued read's batch, once read, which must be of the
  // examples at `indices`; rethrows the error the read threw.
  std::shared_ptr<void> pop(const std::vector<size_t>& indices);

 private:
  struct Job {
    std::vector<size_t> indices;
    std::packaged_task<std::shared_ptr<void>()> task;
    std::future<std::shared_ptr<void>> batch;
  };
  void work();

  const size_t depth_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> jobs_;  // oldest first: read, being read, or waiting
  size_t next_ = 0;                        // jobs_[next_] is the next to read
  bool started_ = false;                   // the reading thread has set its thread count
  bool stop_ = false;
  std::thread thread_;
};

} // namespace detail
} // namespace memfit
