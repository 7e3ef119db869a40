// The seed of randomized tests: UCPFS_TEST_SEED when set, else random; printed once so any
// failing run can be replayed.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace ucpfs::testing {

inline uint64_t TestSeed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* e = std::getenv("UCPFS_TEST_SEED"); e != nullptr && *e != '\0') {
      s = std::strtoull(e, nullptr, 10);
    } else {
      s = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
    }
    std::cout << "[ seed ] UCPFS_TEST_SEED=" << s << "\n";
    return s;
  }();
  return seed;
}

}  // namespace ucpfs::testing
