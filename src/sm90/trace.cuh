// A timeline of the attention kernel for measurement builds (-DSAGE_SM90_TRACE=1, the `trace`
// stage of scripts/gpu_run.sh; off and compiled away otherwise): one thread per role of the
// first few CTAs writes (SM clock, event) pairs, which bench/trace_report.py turns into the
// time of each stage of an item and of a K/V tile. The consumers record on the pipelined K/V
// loop only (the variants that run one tile at a time have no tile events).
//
// Why: the stall-sample profiles (docs/performance.md) say where warps wait but not for how
// long per item or tile, and the probes that removed work changed what the rest did. A clock
// read is one instruction on the recording thread only; everything else in the kernel stays.
#pragma once

#include <cstdint>

#ifndef SAGE_SM90_TRACE
#define SAGE_SM90_TRACE 0
#endif

namespace sage::sm90::trace {

enum Event : uint32_t {
  item_begin = 1,  // consumer: an item's first instruction
  q_ready,         // consumer: Q codes in shared memory (its own prologue or the stage's)
  kv_full,         // consumer: a K/V tile's full barrier passed
  s_ready,         // consumer: the tile's QK product waited for
  softmax_done,    // consumer: P~ of the tile computed
  pv_done,         // consumer: the previous tile's PV product waited for
  tile_done,       // consumer: fold and pack done, the tile's stage released
  epilogue_begin,  // consumer: after the last fold
  epilogue_end,    // consumer: the output stored
  kv_issued,       // producer: a K/V tile's TMA issued (after its empty wait)
  stage_begin,     // Q stage: raw tile landed, buffer free
  stage_end,       // Q stage: codes written
};

// Recorded CTAs (slot k: CTA k * gridDim.x / kCtas), roles per CTA (0 producer, 1 .. 3 consumer warpgroups, 4 the Q stage) and
// events per role.
constexpr int kCtas = 8, kRoles = 5, kEvents = 8192;

#if SAGE_SM90_TRACE
static __device__ unsigned long long g_events[kCtas][kRoles][kEvents];

struct Recorder {
  unsigned long long* row = nullptr;
  int n = 0;
  // CTAs 0, s, 2s, .. (s = gridDim.x / kCtas): spread over the launch's waves, since the first
  // wave starts in lock-step and later ones do not.
  __device__ Recorder(int role, bool recording) {
    const unsigned stride = gridDim.x >= kCtas ? gridDim.x / kCtas : 1;
    if (recording && blockIdx.x % stride == 0 && blockIdx.x / stride < kCtas)
      row = g_events[blockIdx.x / stride][role];
  }
  __device__ __forceinline__ void operator()(Event e) {
    if (row && n < kEvents) row[n++] = (static_cast<unsigned long long>(clock64()) << 8) | e;
  }
};
#else
struct Recorder {
  __device__ Recorder(int, bool) {}
  __device__ __forceinline__ void operator()(Event) {}
};
#endif

}  // namespace sage::sm90::trace
