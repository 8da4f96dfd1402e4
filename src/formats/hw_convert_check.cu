// The hardware side of the conversion check declared in hw_convert_check.h.
#include "formats/hw_convert_check.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_status.h"
#include "sage/error.h"
#include "numerics/formats.h"

namespace sage::hw {
namespace {

enum class Enc : int { e4m3, e5m2, f16, f16_satfinite, bf16 };
constexpr Enc kEncoders[] = {Enc::e4m3, Enc::e5m2, Enc::f16, Enc::f16_satfinite, Enc::bf16};

const char* encoder_name(Enc e) {
  switch (e) {
    case Enc::e4m3: return "cvt.rn.satfinite.e4m3x2.f32 vs fmt::e4m3_encode";
    case Enc::e5m2: return "cvt.rn.satfinite.e5m2x2.f32 vs fmt::e5m2_encode";
    case Enc::f16: return "cvt.rn.f16.f32 vs fmt::fp16_bits";
    case Enc::f16_satfinite: return "cvt.rn.satfinite.f16.f32 vs fmt::round_fp16_satfinite";
    case Enc::bf16: return "cvt.rn.bf16.f32 vs fmt::bf16_bits";
  }
  return "?";
}

__device__ uint32_t hw_encode(Enc e, float x) {
  uint16_t r = 0;
  // The x2 forms pack their first source into the high byte; x goes second, so it lands low.
  switch (e) {
    case Enc::e4m3:
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(x));
      return r & 0xFFu;
    case Enc::e5m2:
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(x));
      return r & 0xFFu;
    case Enc::f16: asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
    case Enc::f16_satfinite: asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
    case Enc::bf16: asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
  }
  return 0;
}

__host__ __device__ uint32_t sw_encode(Enc e, float x) {
  switch (e) {
    case Enc::e4m3: return fmt::e4m3_encode(x);
    case Enc::e5m2: return fmt::e5m2_encode(x);
    case Enc::f16: return fmt::fp16_bits(x);
    case Enc::f16_satfinite: return fmt::fp16_bits(fmt::round_fp16_satfinite(x));
    case Enc::bf16: return fmt::bf16_bits(x);
  }
  return 0;
}

// A mismatch is recorded as one 64-bit key, input bits high, so atomicMin keeps the smallest
// mismatching input together with both outputs.
struct Tally {
  unsigned long long mismatches;
  unsigned long long first;  // input << 32 | hardware << 16 | software
};

__device__ void record(Tally* t, uint32_t input, uint32_t hw, uint32_t sw) {
  atomicAdd(&t->mismatches, 1ull);
  const unsigned long long key = (static_cast<unsigned long long>(input) << 32) |
                                 (static_cast<unsigned long long>(hw & 0xFFFFu) << 16) | (sw & 0xFFFFu);
  atomicMin(&t->first, key);
}

__global__ void sweep_all_floats(Enc e, Tally* t) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const uint32_t bits = static_cast<uint32_t>(i);
    const float x = __uint_as_float(bits);
    const uint32_t hw = hw_encode(e, x), sw = sw_encode(e, x);
    if (hw != sw) record(t, bits, hw, sw);
  }
}

// The sample for the host comparison: every one of the 2^24 high bit patterns (all exponents,
// 15 mantissa bits, both signs) with a scrambled low byte for the sticky bits.
__host__ __device__ uint32_t sample_input(uint32_t i) {
  return (i << 8) | ((i * 0x9E3779B1u) >> 24);
}
constexpr uint32_t kSample = 1u << 24;

__global__ void encode_sample(Enc e, uint16_t* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kSample) out[i] = static_cast<uint16_t>(hw_encode(e, __uint_as_float(sample_input(i))));
}

enum class Dec : int { e4m3, e5m2, f16 };

__device__ float hw_decode(Dec d, uint32_t c) {
  uint16_t h = 0;
  float f = 0.f;
  uint32_t pair = 0;
  switch (d) {
    case Dec::e4m3:
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(static_cast<uint16_t>(c)));
      h = static_cast<uint16_t>(pair & 0xFFFFu);
      break;
    case Dec::e5m2:
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(pair) : "h"(static_cast<uint16_t>(c)));
      h = static_cast<uint16_t>(pair & 0xFFFFu);
      break;
    case Dec::f16: h = static_cast<uint16_t>(c); break;
  }
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ float sw_decode(Dec d, uint32_t c) {
  switch (d) {
    case Dec::e4m3: return fmt::e4m3_decode(static_cast<uint8_t>(c));
    case Dec::e5m2: return fmt::e5m2_decode(static_cast<uint8_t>(c));
    case Dec::f16: return fmt::fp16_from_bits(static_cast<uint16_t>(c));
  }
  return 0.f;
}

__global__ void decode_all_codes(Dec d, uint32_t codes, Tally* t) {
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= codes) return;
  const float hw = hw_decode(d, c), sw = sw_decode(d, c);
  const bool same = (hw != hw) ? (sw != sw) : __float_as_uint(hw) == __float_as_uint(sw);
  // Decoded values are reported by their fp16 bits, which hold every value compared here.
  if (!same) record(t, c, __float_as_uint(hw) >> 16, __float_as_uint(sw) >> 16);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw CudaError(std::string("hw_convert_check: ") + what + ": " + cudaGetErrorString(err));
}

ConvertCheck from_tally(const std::string& name, uint64_t inputs, const Tally& t) {
  ConvertCheck c;
  c.conversion = name;
  c.inputs = inputs;
  c.mismatches = t.mismatches;
  if (t.mismatches > 0) {
    c.first_input = static_cast<uint32_t>(t.first >> 32);
    c.hardware = static_cast<uint32_t>((t.first >> 16) & 0xFFFFu);
    c.software = static_cast<uint32_t>(t.first & 0xFFFFu);
  }
  return c;
}

// Device buffers freed on every path, including a throw between allocation and the end.
template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(size_t n) { check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

template <class Launch>
Tally run_tally(Launch launch) {
  DeviceBuffer<Tally> d(1);
  const Tally init{0ull, ~0ull};
  check(cudaMemcpy(d.p, &init, sizeof init, cudaMemcpyHostToDevice), "cudaMemcpy");
  launch(d.p);
  check(cudaGetLastError(), "kernel launch");
  check(cudaDeviceSynchronize(), "kernel");
  Tally t{};
  check(cudaMemcpy(&t, d.p, sizeof t, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return t;
}

}  // namespace

bool hw_convert_check_supported(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (why)
      *why = err != cudaSuccess ? cuda_unavailable_reason(err) : "no CUDA device is present";
    cudaGetLastError();  // do not leave a sticky error for the next test
    return false;
  }
  int dev = 0, major = 0, minor = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "attribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "attribute");
  if (major < 9) {
    if (why)
      *why = "the GPU has compute capability " + std::to_string(major) + "." + std::to_string(minor) +
             "; the FP8 conversions need 9.0 or newer";
    return false;
  }
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, sweep_all_floats) != cudaSuccess) {
    cudaGetLastError();
    if (why)
      *why = "this build has no kernel image for the GPU (compute capability " +
             std::to_string(major) + "." + std::to_string(minor) +
             "); add it to SAGE_CUDA_ARCHITECTURES";
    return false;
  }
  return true;
}

std::vector<ConvertCheck> run_hw_convert_check() {
  std::vector<ConvertCheck> results;

  for (Enc e : kEncoders) {
    const Tally t = run_tally([e](Tally* d) { sweep_all_floats<<<4096, 256>>>(e, d); });
    results.push_back(from_tally(std::string(encoder_name(e)) + " (device, all 2^32 inputs)",
                                 1ull << 32, t));
  }

  {
    DeviceBuffer<uint16_t> d(kSample);
    std::vector<uint16_t> h(kSample);
    for (Enc e : kEncoders) {
      encode_sample<<<kSample / 256, 256>>>(e, d.p);
      check(cudaGetLastError(), "kernel launch");
      check(cudaMemcpy(h.data(), d.p, kSample * sizeof(uint16_t), cudaMemcpyDeviceToHost),
            "cudaMemcpy");
      ConvertCheck c;
      c.conversion = std::string(encoder_name(e)) + " (host, 2^24-input sample)";
      c.inputs = kSample;
      for (uint32_t i = 0; i < kSample; ++i) {
        const uint32_t bits = sample_input(i);
        float x;
        std::memcpy(&x, &bits, sizeof x);
        const uint32_t sw = sw_encode(e, x);
        if (sw != h[i] && c.mismatches++ == 0) {
          c.first_input = bits;
          c.hardware = h[i];
          c.software = sw;
        }
      }
      results.push_back(c);
    }
  }

  const struct {
    Dec d;
    uint32_t codes;
    const char* name;
  } decoders[] = {{Dec::e4m3, 256, "cvt.rn.f16x2.e4m3x2 vs fmt::e4m3_decode (every code)"},
                  {Dec::e5m2, 256, "cvt.rn.f16x2.e5m2x2 vs fmt::e5m2_decode (every code)"},
                  {Dec::f16, 65536, "cvt.f32.f16 vs fmt::fp16_from_bits (every code)"}};
  for (const auto& dec : decoders) {
    const Dec which = dec.d;
    const uint32_t codes = dec.codes;
    const Tally t = run_tally([which, codes](Tally* d) {
      decode_all_codes<<<(codes + 255) / 256, 256>>>(which, codes, d);
    });
    results.push_back(from_tally(dec.name, dec.codes, t));
  }
  return results;
}

}  // namespace sage::hw
