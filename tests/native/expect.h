// The native tests' check: EXPECT(cond) reports a false condition with its file and line and counts it in
// native_test::failures (atomic: the graph cache test checks from several threads); each test's main returns
// non-zero when any failed.
#pragma once

#include <atomic>
#include <cstdio>

namespace native_test {
inline std::atomic<int> failures{0};
}  // namespace native_test

#define EXPECT(cond)                                                           \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++native_test::failures;                                                 \
    }                                                                          \
  } while (0)
