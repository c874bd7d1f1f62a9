#include "model/thread_pool.h"

#include <atomic>

namespace kvbridge::model_internal {

struct ThreadPool::Job {
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t n;
  int64_t grain;
  int64_t pieces;
  std::atomic<int64_t> next{0};  // next piece to claim
  Mutex mu;
  std::condition_variable done_cv;
  int64_t done GUARDED_BY(mu) = 0;
};

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunPieces(Job& job) {
  int64_t ran = 0;
  for (;;) {
    // relaxed: the claim only needs atomicity; results are published through job.mu below.
    const int64_t piece = job.next.fetch_add(1, std::memory_order_relaxed);
    if (piece >= job.pieces) break;
    const int64_t begin = piece * job.grain;
    const int64_t end = std::min(job.n, begin + job.grain);
    (*job.fn)(begin, end);
    ++ran;
  }
  if (ran > 0) {
    MutexLock lock(&job.mu);
    job.done += ran;
    if (job.done == job.pieces) job.done_cv.notify_all();
  }
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      MutexLock lock(&mu_);
      cv_.wait(lock.native(), [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (stop_) return;
      job = queue_.front();
      queue_.pop_front();
    }
    RunPieces(*job);
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t pieces = (n + grain - 1) / grain;
  if (workers_.empty() || pieces == 1) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->grain = grain;
  job->pieces = pieces;
  {
    MutexLock lock(&mu_);
    // One queue entry per worker that could help; each entry lets one worker join the job.
    const int64_t helpers = std::min<int64_t>(pieces - 1, static_cast<int64_t>(workers_.size()));
    for (int64_t i = 0; i < helpers; ++i) queue_.push_back(job);
  }
  cv_.notify_all();
  RunPieces(*job);
  MutexLock lock(&job->mu);
  job->done_cv.wait(lock.native(), [&]() REQUIRES(job->mu) { return job->done == job->pieces; });
}

}  // namespace kvbridge::model_internal
