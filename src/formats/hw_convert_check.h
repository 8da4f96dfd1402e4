// Compares the GPU's conversion instructions with the encoders of numerics/formats.h, bit for bit.
//
// The CPU simulator is only as faithful as sage::fmt is to the hardware, and the PTX manual
// leaves corner cases (NaN codes, saturation of infinities) to the implementation. This check
// settles them on a real device: a test runs it wherever an sm_90 GPU is present.
// Defined only in builds with CUDA (src/formats/hw_convert_check.cu).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sage::hw {

struct ConvertCheck {
  std::string conversion;        // "<PTX instruction> vs <sage::fmt function> (<where>)"
  uint64_t inputs = 0;           // how many inputs were compared
  uint64_t mismatches = 0;
  uint32_t first_input = 0;      // bits of the smallest mismatching input (when mismatches > 0)
  uint32_t hardware = 0;         // what the instruction gave for it
  uint32_t software = 0;         // what sage::fmt gave for it
};

// True when the current CUDA device can run the check (compute capability 9.0 or newer and a
// kernel image in this build for it); otherwise `why` says what is missing.
bool hw_convert_check_supported(std::string* why);

// Runs, on the current device:
//  * every encoder over all 2^32 float32 bit patterns against the device-compiled sage::fmt
//    function (cvt.rn.satfinite.e4m3x2.f32, cvt.rn.satfinite.e5m2x2.f32, cvt.rn.f16.f32,
//    cvt.rn.satfinite.f16.f32, cvt.rn.bf16.f32);
//  * the same instructions over a 2^24-input sample against the host-compiled functions, so
//    that host and device agree too;
//  * every code of the decoders (cvt.rn.f16x2.e4m3x2 / .e5m2x2, cvt.f32.f16); NaN codes
//    compare as "both NaN".
// Throws sage::CudaError when a CUDA call fails.
std::vector<ConvertCheck> run_hw_convert_check();

}  // namespace sage::hw
