// The graph cache template (ffi/lru_graph_cache.h) on a CPU, for tests/test_extension.py: its LRU order and
// counters, one build per key however many callers ask at once, callers of other keys never waiting on a
// build in progress, failures handed to every waiter and then forgotten. Builds here are stand-ins that
// block on a gate the test opens. Exits 0 when every check passes; a caller stuck on someone else's build
// is reported by a watchdog (exit 2) instead of hanging the test run.
#include "lru_graph_cache.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "expect.h"

namespace {

using jax_ragged_attn::LruCacheStats;
using jax_ragged_attn::LruGraphCache;
using Error = xla::ffi::Error;

struct Graph {
  int built_for = -1;
};
using Cache = LruGraphCache<int, Graph>;

// A one-shot gate: builds wait on it, the test opens it.
class Gate {
 public:
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Runs fn on a thread of its own and fails the whole program if it does not return within 20 s: a caller
// that waits on another key's build would otherwise hang here forever.
template <typename Fn>
void within_deadline(const char* what, Fn&& fn) {
  std::atomic<bool> done{false};
  std::thread worker([&] {
    fn();
    done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!done) {
    std::fprintf(stderr, "%s: still waiting after 20 s, blocked behind a build in progress\n", what);
    std::_Exit(2);
  }
  worker.join();
}

// Until `n` lookups have reached the cache (each counts as a hit or a miss under the cache's lock).
void wait_for_lookups(const Cache& cache, int64_t n) {
  within_deadline("waiting for the callers to reach the cache", [&] {
    while (cache.stats().hits + cache.stats().misses < n) std::this_thread::yield();
  });
}

std::shared_ptr<const Graph> get(Cache& cache, int key, std::atomic<int>* builds = nullptr, bool* built = nullptr) {
  std::shared_ptr<const Graph> out;
  const Error status = cache.get(
      key,
      [&](Graph* g) {
        if (builds) ++*builds;
        g->built_for = key;
        return Error::Success();
      },
      &out, built);
  EXPECT(status.success());
  return out;
}

void lru_order_and_counters() {
  Cache cache(2);
  bool built = false;
  get(cache, 1, nullptr, &built);
  EXPECT(built);
  get(cache, 2);
  EXPECT(get(cache, 1, nullptr, &built)->built_for == 1);
  EXPECT(!built);
  get(cache, 3);  // evicts 2, the least recently used
  std::atomic<int> builds{0};
  get(cache, 1, &builds);
  EXPECT(builds == 0);
  get(cache, 2, &builds);  // rebuilt: it was evicted
  EXPECT(builds == 1);
  const LruCacheStats s = cache.stats();
  EXPECT(s.hits == 2);
  EXPECT(s.misses == 4);
  EXPECT(s.evictions == 2);  // 2, then 3
  EXPECT(s.size == 2);
  EXPECT(s.capacity == 2);

  cache.set_capacity(0);  // at least one
  EXPECT(cache.stats().capacity == 1);
  EXPECT(cache.stats().size == 1);
  EXPECT(cache.stats().evictions == 3);
  builds = 0;
  get(cache, 2, &builds);  // the most recently used stayed
  EXPECT(builds == 0);
}

void one_build_for_many_callers_of_a_key() {
  Cache cache(8);
  Gate gate;
  std::atomic<int> builds{0};
  std::vector<std::shared_ptr<const Graph>> results(8);
  std::vector<std::thread> callers;
  for (int i = 0; i < 8; ++i) {
    callers.emplace_back([&, i] {
      const Error status = cache.get(
          7,
          [&](Graph* g) {
            ++builds;
            gate.wait();
            g->built_for = 7;
            return Error::Success();
          },
          &results[i]);
      EXPECT(status.success());
    });
  }
  wait_for_lookups(cache, 8);  // every caller is in: one building, seven waiting
  gate.open();
  for (std::thread& t : callers) t.join();
  EXPECT(builds == 1);
  for (const auto& r : results) EXPECT(r != nullptr && r == results[0] && r->built_for == 7);
  EXPECT(cache.stats().misses == 1);
  EXPECT(cache.stats().hits == 7);
}

void other_keys_never_wait_on_a_build() {
  Cache cache(8);
  get(cache, 1);  // built before
  Gate gate;
  std::atomic<bool> building{false}, finished{false};
  std::thread slow([&] {
    std::shared_ptr<const Graph> out;
    cache.get(
        2,
        [&](Graph* g) {
          building = true;
          gate.wait();
          g->built_for = 2;
          return Error::Success();
        },
        &out);
    finished = true;
  });
  while (!building) std::this_thread::yield();
  within_deadline("a hit on another key", [&] { EXPECT(get(cache, 1)->built_for == 1); });
  within_deadline("a build of another key", [&] { EXPECT(get(cache, 3)->built_for == 3); });
  within_deadline("the stats", [&] { EXPECT(cache.stats().size == 3); });
  within_deadline("a capacity change", [&] { cache.set_capacity(8); });
  EXPECT(!finished);  // all of the above happened while key 2 was still building
  gate.open();
  slow.join();
  EXPECT(get(cache, 2)->built_for == 2);
}

void failures_reach_every_waiter_and_are_forgotten() {
  Cache cache(8);
  Gate gate;
  std::atomic<int> builds{0};
  std::vector<Error> statuses(4);
  std::vector<std::shared_ptr<const Graph>> results(4);
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      statuses[i] = cache.get(
          5,
          [&](Graph*) {
            ++builds;
            gate.wait();
            return Error(xla::ffi::ErrorCode::kUnimplemented, "not supported");
          },
          &results[i]);
    });
  }
  wait_for_lookups(cache, 4);
  gate.open();
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < 4; ++i) {
    EXPECT(statuses[i].failure() && *statuses[i].errc() == xla::ffi::ErrorCode::kUnimplemented);
    EXPECT(statuses[i].message() == "not supported");
    EXPECT(results[i] == nullptr);
  }
  EXPECT(cache.stats().size == 0);  // not cached: the next call builds again
  get(cache, 5, &builds);
  EXPECT(builds == 2);
  EXPECT(cache.stats().size == 1);
}

void an_exception_is_an_error() {
  Cache cache(8);
  std::shared_ptr<const Graph> out;
  const Error status = cache.get(4, [](Graph*) -> Error { throw std::runtime_error("frontend says no"); }, &out);
  EXPECT(status.failure() && *status.errc() == xla::ffi::ErrorCode::kInternal);
  EXPECT(status.message().find("frontend says no") != std::string::npos);
  EXPECT(out == nullptr);
  EXPECT(cache.stats().size == 0);
}

void evicting_a_build_in_progress_still_answers_its_callers() {
  Cache cache(1);
  Gate gate;
  std::atomic<bool> building{false};
  std::shared_ptr<const Graph> builder_result, waiter_result;
  std::thread builder([&] {
    cache.get(
        1,
        [&](Graph* g) {
          building = true;
          gate.wait();
          g->built_for = 1;
          return Error::Success();
        },
        &builder_result);
  });
  while (!building) std::this_thread::yield();
  std::thread waiter([&] { waiter_result = get(cache, 1); });  // files no build: it waits on the builder's slot
  wait_for_lookups(cache, 2);
  within_deadline("a build that evicts the one in progress", [&] { get(cache, 2); });
  EXPECT(cache.stats().evictions == 1);
  gate.open();
  builder.join();
  waiter.join();
  EXPECT(builder_result && builder_result->built_for == 1);
  EXPECT(waiter_result == builder_result);
  EXPECT(cache.stats().size == 1);
  EXPECT(get(cache, 2)->built_for == 2);
}

}  // namespace

int main() {
  lru_order_and_counters();
  one_build_for_many_callers_of_a_key();
  other_keys_never_wait_on_a_build();
  failures_reach_every_waiter_and_are_forgotten();
  an_exception_is_an_error();
  evicting_a_build_in_progress_still_answers_its_callers();
  if (const int failed = native_test::failures.load()) {
    std::fprintf(stderr, "%d check(s) failed\n", failed);
    return 1;
  }
  std::printf("lru_graph_cache: every check passed\n");
  return 0;
}
