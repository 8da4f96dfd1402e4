// Work splitting for the CPU references: independent (batch, head) items over a few threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace sage::reference {

// Runs f(i) for i in [0, n). Items are handed out one at a time because their costs differ
// (causal rows, GQA groups). f must not throw: callers validate everything beforehand.
template <class F>
void parallel_for(int64_t n, F&& f) {
  const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t workers = std::min(hw, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto loop = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < workers; ++t) pool.emplace_back(loop);
  loop();
  for (auto& t : pool) t.join();
}

}  // namespace sage::reference
