// The PTX conversion instructions against sage::fmt, bit for bit, on a real GPU.
//
// The CPU simulator's claim to reproduce the kernels rests on these encoders; this is where
// that claim meets the hardware. It skips (visibly) where it cannot run.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#ifdef SAGE_WITH_CUDA
#include "formats/hw_convert_check.h"
#endif

namespace {

#ifdef SAGE_WITH_CUDA
std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%X", v);
  return buf;
}
#endif

TEST(FormatsGpu, HardwareConversionsMatchEncodersBitForBit) {
#ifndef SAGE_WITH_CUDA
  GTEST_SKIP() << "this build has no CUDA (configured with SAGE_CUDA=OFF): the hardware "
                  "conversions cannot be compared with sage::fmt";
#else
  std::string why;
  if (!sage::hw::hw_convert_check_supported(&why))
    GTEST_SKIP() << "needs a CUDA GPU of compute capability >= 9.0: " << why;
  const auto results = sage::hw::run_hw_convert_check();
  ASSERT_FALSE(results.empty());
  for (const auto& c : results) {
    EXPECT_GT(c.inputs, 0u) << c.conversion;
    EXPECT_EQ(c.mismatches, 0u) << c.conversion << ": " << c.mismatches << " of " << c.inputs
                                << " differ; the smallest input " << hex(c.first_input)
                                << " gives " << hex(c.hardware) << " in hardware and "
                                << hex(c.software) << " in sage::fmt";
  }
#endif
}

}  // namespace
