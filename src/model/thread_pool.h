// Internal: a small fixed thread pool whose ParallelFor may be called from several threads at
// once (concurrent Forward calls share one pool). The caller takes part in its own job, so a
// job always makes progress even when every worker is busy with another caller's job.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kvbridge/common/thread_annotations.h"

namespace kvbridge::model_internal {

class ThreadPool {
 public:
  /// `num_threads` includes the caller: num_threads - 1 workers are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  /// Runs fn(begin, end) over [0, n) in pieces of `grain`; returns when all pieces ran.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();
  static void RunPieces(Job& job);

  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvbridge::model_internal
