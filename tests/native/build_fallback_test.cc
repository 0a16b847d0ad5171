// ffi/build_fallback.h on a CPU, for tests/test_extension.py: the second way is tried only where the first
// failed or threw, a success of either is returned as it is, and where both fail the error carries the
// second's code and both messages. Exits 0 when every check passes.
#include "build_fallback.h"

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect.h"

namespace {

using Error = xla::ffi::Error;
using jax_ragged_attn::build_first_that_works;
using jax_ragged_attn::ErrorStream;

enum class Way { kFirst, kSecond };

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A stand-in build: what each way does ("ok", "unsupported", "internal" or "throw"), and the ways it was asked.
struct StandIn {
  std::string first, second;
  std::vector<Way> asked;

  Error operator()(Way way) {
    asked.push_back(way);
    const std::string& what = way == Way::kFirst ? first : second;
    const char* name = way == Way::kFirst ? "first" : "second";
    if (what == "throw") throw std::runtime_error(std::string(name) + " threw");
    if (what == "unsupported") return ErrorStream(xla::ffi::ErrorCode::kUnimplemented) << name << " unsupported";
    if (what == "internal") return ErrorStream(xla::ffi::ErrorCode::kInternal) << name << " failed";
    return Error::Success();
  }
};

Error run(StandIn& stand_in) {
  return build_first_that_works([&](Way way) { return stand_in(way); }, Way::kFirst, Way::kSecond, "FIRST");
}

}  // namespace

int main() {
  {  // The first way works: the second is never asked.
    StandIn s{"ok", "throw"};
    EXPECT(!run(s).failure());
    EXPECT(s.asked.size() == 1 && s.asked[0] == Way::kFirst);
  }
  for (const char* first : {"internal", "unsupported", "throw"}) {  // any failure of the first: the second runs
    StandIn s{first, "ok"};
    EXPECT(!run(s).failure());
    EXPECT(s.asked.size() == 2 && s.asked[1] == Way::kSecond);
  }
  {  // Both fail: the second's code, both messages, the first's named.
    StandIn s{"internal", "unsupported"};
    const Error e = run(s);
    EXPECT(e.failure());
    EXPECT(e.errc() == xla::ffi::ErrorCode::kUnimplemented);
    EXPECT(contains(e.message(), "second unsupported"));
    EXPECT(contains(e.message(), "with FIRST: first failed"));
  }
  {  // A throwing second way is an internal error, not an exception out of the helper.
    StandIn s{"unsupported", "throw"};
    const Error e = run(s);
    EXPECT(e.errc() == xla::ffi::ErrorCode::kInternal);
    EXPECT(contains(e.message(), "second threw"));
    EXPECT(contains(e.message(), "first unsupported"));
  }
  const int failed = native_test::failures.load();
  if (failed) std::fprintf(stderr, "%d checks failed\n", failed);
  return failed ? 1 : 0;
}
