// The one graph cache: a bounded least-recently-used map from a key (device, configuration, ...) to a built
// graph, shared by the ragged graphs (graph_cache.cc) and the paged ones (paged_graph.cc).
//
// A build takes long (tens to hundreds of milliseconds) and must not stall anyone else, so the cache's mutex
// is held only to look a key up or to file a slot for it, never while building:
//   - the first caller for a key files a slot (a shared_future) and builds outside the lock;
//   - later callers for the same key wait on that slot, so each key is built once;
//   - callers for any other key, on any device, go through without waiting on that build.
// A failed build is handed to every caller waiting on it and then forgotten: the next call tries again.
//
// A training job that varies max_seqlen per step would otherwise keep every graph (and its cuDNN plans)
// alive forever, hence the bound. Callers keep a shared_ptr, so evicting a graph that is executing is safe;
// evicting a slot whose build is still running is too (its waiters hold the future).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

struct LruCacheStats {
  int64_t hits = 0;       // found built, or built meanwhile by another caller this one waited for
  int64_t misses = 0;     // builds started
  int64_t evictions = 0;  // slots dropped to keep within the capacity
  int64_t size = 0;       // slots held, builds in progress included
  int64_t capacity = 0;
};

// Key needs operator<. Value is default-constructible; the build fills it in.
template <typename Key, typename Value>
class LruGraphCache {
 public:
  explicit LruGraphCache(int64_t capacity) : capacity_(std::max<int64_t>(capacity, 1)) {}
  LruGraphCache(const LruGraphCache&) = delete;
  LruGraphCache& operator=(const LruGraphCache&) = delete;

  // The value for `key`, built first with `build(Value*)` (which returns xla::ffi::Error) when no caller
  // has built it or is building it. `*built` (if given) says whether this call ran the build. An exception
  // out of `build` comes back as kInternal, so that the callers waiting on it are released too.
  template <typename Build>
  xla::ffi::Error get(const Key& key, Build&& build, std::shared_ptr<const Value>* out, bool* built = nullptr) {
    if (built) *built = false;
    std::promise<Outcome> promise;
    std::shared_future<Outcome> pending;
    bool mine = false;  // this call filed the slot, so it builds
    uint64_t slot_id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        order_.splice(order_.begin(), order_, it->second.position);  // most recently used first
        ++stats_.hits;
        pending = it->second.outcome;
      } else {
        ++stats_.misses;
        mine = true;
        pending = promise.get_future().share();
        slot_id = ++slots_filed_;
        order_.push_front(key);
        entries_.emplace(key, Slot{pending, slot_id, order_.begin()});
        evict_locked();
      }
    }
    if (!mine) {
      // Someone else's slot: built already, or wait for it (the lock is not held here).
      const Outcome& outcome = pending.get();
      *out = outcome.second;
      return outcome.first;
    }
    if (built) *built = true;
    Outcome outcome = run(std::forward<Build>(build));
    if (outcome.first.failure()) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      // Forget the failure, unless the slot was evicted (and perhaps filed anew by another caller) meanwhile.
      if (it != entries_.end() && it->second.id == slot_id) {
        order_.erase(it->second.position);
        entries_.erase(it);
      }
    }
    promise.set_value(outcome);
    *out = outcome.second;
    return outcome.first;
  }

  void set_capacity(int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    capacity_ = std::max<int64_t>(capacity, 1);
    evict_locked();
  }

  LruCacheStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    LruCacheStats s = stats_;
    s.size = static_cast<int64_t>(entries_.size());
    s.capacity = capacity_;
    return s;
  }

 private:
  using Outcome = std::pair<xla::ffi::Error, std::shared_ptr<const Value>>;
  struct Slot {
    std::shared_future<Outcome> outcome;
    uint64_t id;  // tells a slot from one filed later under the same key
    typename std::list<Key>::iterator position;
  };

  template <typename Build>
  static Outcome run(Build&& build) {
    // The value is made inside the try too: whatever throws (a bad_alloc included) becomes an error that
    // releases every waiter and forgets the slot, never an exception out of get() with the promise unset.
    std::shared_ptr<Value> value;
    xla::ffi::Error status;
    try {
      value = std::make_shared<Value>();
      status = build(value.get());
    } catch (const std::exception& e) {
      status = xla::ffi::Error(xla::ffi::ErrorCode::kInternal, std::string("building the graph threw: ") + e.what());
    } catch (...) {
      status = xla::ffi::Error(xla::ffi::ErrorCode::kInternal, "building the graph threw a non-standard exception");
    }
    if (status.failure()) return {status, nullptr};
    return {status, std::move(value)};
  }

  void evict_locked() {
    while (static_cast<int64_t>(entries_.size()) > capacity_) {
      entries_.erase(order_.back());
      order_.pop_back();
      ++stats_.evictions;
    }
  }

  mutable std::mutex mutex_;
  int64_t capacity_;
  std::list<Key> order_;  // most recently used first
  std::map<Key, Slot> entries_;
  LruCacheStats stats_;
  uint64_t slots_filed_ = 0;
};

}  // namespace jax_ragged_attn
