// `sage bench`: the benchmark protocol of DESIGN.md for this library's own kernels.
//
// What is timed is the whole call a user makes, sage::attention() including its quantization
// passes, on fp16/bf16 inputs already on the device. Each point is the median of CUDA-event
// timings of single calls after warm-up, with the inputs rotated over enough copies that the
// L2 cache cannot hold them from one call to the next.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "common.h"
#include "gpu.h"
#include "recipe_text.h"
#include "sage/attention.h"
#include "numerics/formats.h"
#include "numerics/mask.h"
#ifdef SAGE_WITH_CUDA
#include "sm90/fwd/tile_scheduler.h"
#endif

namespace sage::cli {
namespace {

struct BenchConfig {
  std::vector<std::string> recipes, dtypes, causal;
  std::vector<int64_t> dims, ns;
  int64_t heads = 32, kv_heads = 32, tokens = 32768;
  int64_t warmup = 5, iters = 30;
  bool split = false;  // also time the two steps (quantize_kv, attention_from_quantized_kv) alone
  int64_t k_mean_stride = 0;  // > 0: instead of each preset's (recipe.k_mean_stride)
  WindowFlag window;          // --window: a sliding window at every point
  std::string order = "auto";  // --order / --items-per-cta: the tile scheduler's choices, forced
  int64_t items_per_cta = 0;
  std::string json;
};

#ifdef SAGE_WITH_CUDA
// The query-key pairs a point counts: N^2 (N^2 / 2 under a causal mask, as the records have
// always counted it); under a window, exactly the pairs the mask leaves visible, summed over
// the rows: the work the kernel computes, without the masked entries of its edge tiles.
double counted_pairs(const BenchConfig& c, int64_t n, bool causal) {
  const double all = static_cast<double>(n) * static_cast<double>(n);
  if (!c.window.given()) return causal ? all / 2 : all;
  const KeyWindow w = normalized_window(causal, c.window.left, c.window.right, n, n);
  double pairs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const KeyRange keys = visible_keys(i, n, n, w);
    if (!keys.empty()) pairs += static_cast<double>(keys.end - keys.begin);
  }
  return pairs;
}

double tops(const BenchConfig& c, int64_t batch, int64_t n, int64_t d, bool causal, double ms) {
  const double ops = 4.0 * static_cast<double>(batch) * static_cast<double>(c.heads) *
                     counted_pairs(c, n, causal) * static_cast<double>(d);
  return ops / (ms * 1e-3) / 1e12;
}

struct Inputs {
  DeviceBuffer q, k, v, out;
};

// Fills a device buffer with N(0,1) values of the given dtype, drawn once on the host and
// reused for every shape (only cache residency matters for timing, not the values).
class HostRandom {
 public:
  void ensure(size_t elems, DType dtype) {
    if (bits_.size() >= elems && dtype == dtype_) return;
    dtype_ = dtype;
    bits_.resize(elems);
    std::mt19937_64 gen(0);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (auto& b : bits_) {
      const float x = dist(gen);
      b = dtype == DType::bf16 ? fmt::bf16_bits(x) : fmt::fp16_bits(x);
    }
  }
  // Copies elems values starting at a different offset per tensor, so Q, K and V differ.
  void fill(DeviceBuffer& dst, size_t elems, size_t offset) const {
    std::vector<uint16_t> tmp(elems);
    for (size_t i = 0; i < elems; ++i) tmp[i] = bits_[(i + offset) % bits_.size()];
    dst.upload(tmp.data(), elems * sizeof(uint16_t));
  }

 private:
  std::vector<uint16_t> bits_;
  DType dtype_ = DType::f16;
};

AttentionArgs make_args(const Inputs& in, DType dt, int64_t b, int64_t hq, int64_t hkv, int64_t n,
                        int64_t d, bool causal, const WindowFlag& window, const Recipe& r) {
  AttentionArgs a;
  const Device dev = Device::cuda(0);
  a.q = contiguous_view(in.q.get(), dt, {b, hq, n, d}, dev);
  a.k = contiguous_view(in.k.get(), dt, {b, hkv, n, d}, dev);
  a.v = contiguous_view(in.v.get(), dt, {b, hkv, n, d}, dev);
  a.out = contiguous_view(in.out.get(), dt, {b, hq, n, d}, dev);
  a.layout = Layout::HND;
  a.causal = causal;
  a.window_left = window.left, a.window_right = window.right;
  a.recipe = r;
  return a;
}

// Median milliseconds of c.iters CUDA-event timings of call(i) after c.warmup untimed calls;
// i counts calls, so that the caller rotates its input copies.
template <class Call>
double median_ms(const BenchConfig& c, cudaStream_t stream, Call&& call) {
  for (int64_t i = 0; i < c.warmup; ++i) call(i);
  std::vector<cudaEvent_t> ev(2 * c.iters);
  for (auto& e : ev) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  for (int64_t i = 0; i < c.iters; ++i) {
    cuda_check(cudaEventRecord(ev[2 * i], stream), "cudaEventRecord");
    call(i + c.warmup);
    cuda_check(cudaEventRecord(ev[2 * i + 1], stream), "cudaEventRecord");
  }
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<float> ms(c.iters);
  for (int64_t i = 0; i < c.iters; ++i)
    cuda_check(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return c.iters % 2 ? ms[c.iters / 2] : 0.5 * (ms[c.iters / 2 - 1] + ms[c.iters / 2]);
}

// --order and --items-per-cta force the forward's work order and items per CTA for every
// launch of this process (sm90::set_schedule_overrides): scheduler studies, e.g. under a
// window, compare orders in one run; the default leaves the library's own choice.
void force_schedule(const BenchConfig& c) {
  sm90::ScheduleOverrides o = sm90::schedule_overrides();
  o.items_per_cta = static_cast<int>(c.items_per_cta);
  o.order = c.order == "consecutive" ? sm90::WorkOrderOverride::consecutive
            : c.order == "grouped"   ? sm90::WorkOrderOverride::grouped
            : c.order == "strided"   ? sm90::WorkOrderOverride::strided
                                     : sm90::WorkOrderOverride::automatic;
  sm90::set_schedule_overrides(o);
}

int run_grid(const BenchConfig& c) {
  force_schedule(c);
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::string device = prop.name;
  const size_t l2 = static_cast<size_t>(prop.l2CacheSize);
  std::cout << "device: " << device << " (L2 " << l2 / (1024 * 1024) << " MiB); build: "
            << build_description() << "\n"
            << "whole call (quantization included), median of " << c.iters
            << " CUDA-event timings after " << c.warmup << " warm-up calls\n";
  if (c.order != "auto" || c.items_per_cta > 0)
    std::cout << "schedule forced: order " << c.order << ", items per CTA "
              << (c.items_per_cta > 0 ? std::to_string(c.items_per_cta) : "auto") << "\n";
  std::cout << "\n";

  const int total = static_cast<int>(c.recipes.size() * c.dtypes.size() * c.dims.size() *
                                     c.causal.size() * c.ns.size());
  Progress progress(total, true);
  std::vector<std::string> columns = {"recipe", "dtype", "d",    "causal", "N",
                                      "batch",  "copies", "ms", "TOPS",   "workspace/QKV"};
  std::vector<bool> right = {false, false, true, false, true, true, true, true, true, true};
  if (c.window.given()) {  // after "causal": the mask's two parts side by side
    columns.insert(columns.begin() + 4, "window");
    right.insert(right.begin() + 4, false);
  }
  if (c.split) {
    columns.insert(columns.end(), {"prepass ms", "kernel ms", "kernel TOPS"});
    right.insert(right.end(), {true, true, true});
  }
  Table table(columns, right);
  std::vector<JsonRecord> records;
  // Rows are gathered per recipe so the table reads recipe by recipe, and a recipe refused
  // for one reason at every point takes one row instead of one per point.
  std::vector<std::vector<std::vector<std::string>>> rows(c.recipes.size());
  std::vector<std::set<std::string>> refusals(c.recipes.size());
  std::vector<int> timed(c.recipes.size(), 0);
  HostRandom host;
  Stream stream;
  int failures = 0;

  for (const std::string& dts : c.dtypes) {
    const DType dt = dts == "bf16" ? DType::bf16 : DType::f16;
    for (int64_t d : c.dims)
      for (int64_t n : c.ns) {
        const int64_t batch = std::max<int64_t>(1, c.tokens / n);
        const size_t q_elems = static_cast<size_t>(batch * c.heads * n * d);
        const size_t kv_elems = static_cast<size_t>(batch * c.kv_heads * n * d);
        const size_t qkv_bytes = (q_elems + 2 * kv_elems) * 2;
        const size_t set_bytes = qkv_bytes + q_elems * 2;
        host.ensure(std::max(q_elems, kv_elems) + 4096, dt);
        // Enough copies that one call's inputs were evicted by the ones read since: the
        // copies read between two uses of the same copy must exceed twice the L2.
        size_t copies = std::max<size_t>(2, (2 * l2 + qkv_bytes - 1) / qkv_bytes + 1);
        size_t free_b = 0, total_b = 0;
        cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
        const size_t budget = free_b / 10 * 8;
        if (copies * set_bytes > budget) copies = std::max<size_t>(1, budget / set_bytes);
        std::vector<Inputs> sets;
        for (size_t i = 0; i < copies; ++i) {
          Inputs in{DeviceBuffer(q_elems * 2), DeviceBuffer(kv_elems * 2),
                    DeviceBuffer(kv_elems * 2), DeviceBuffer(q_elems * 2)};
          host.fill(in.q, q_elems, 0);
          host.fill(in.k, kv_elems, 1237);
          host.fill(in.v, kv_elems, 2711);
          sets.push_back(std::move(in));
        }
        for (const std::string& cs : c.causal) {
          const bool causal = cs == "yes";
          for (size_t ri = 0; ri < c.recipes.size(); ++ri) {
            const std::string& rn = c.recipes[ri];
            Recipe recipe = preset(rn);
            if (c.k_mean_stride > 0) apply_k_mean_stride("sage bench", recipe, c.k_mean_stride);
            std::ostringstream what;
            what << rn << " " << dts << " d=" << d << " causal=" << cs << " N=" << n;
            progress.step(what.str());
            std::vector<std::string> head = {rn, dts, std::to_string(d), cs, std::to_string(n),
                                             std::to_string(batch)};
            if (c.window.given()) head.insert(head.begin() + 4, c.window.text());
            JsonRecord rec;
            rec.str("impl", "sagekit").str("recipe", rn).integer("d", d).boolean("causal", causal)
                .integer("n", n).integer("batch", batch).integer("heads", c.heads)
                .integer("kv_heads", c.kv_heads).str("dtype", dts).boolean("whole_call", true)
                .integer("k_mean_stride", recipe.k_mean_stride);
            if (c.window.given()) {
              rec.str("kind", "window").integers("window", {c.window.left, c.window.right});
              rec.num("counted_pairs", counted_pairs(c, n, causal));
            }
            try {
              std::vector<AttentionArgs> args;
              for (const Inputs& in : sets)
                args.push_back(make_args(in, dt, batch, c.heads, c.kv_heads, n, d, causal, c.window, recipe));
              const size_t ws = workspace_bytes(args[0]);
              DeviceBuffer workspace(ws);
              const size_t n_sets = args.size();
              const double med = median_ms(c, stream.get(), [&](int64_t i) {
                attention(args[i % n_sets], workspace.get(), ws, stream.get());
              });
              // The two steps alone: the pre-pass on rotating inputs, and the attention kernel
              // on K/V quantized once per input copy (one workspace each).
              double prepass_ms = 0, kernel_ms = 0;
              if (c.split) {
                prepass_ms = median_ms(c, stream.get(), [&](int64_t i) {
                  quantize_kv(args[i % n_sets], workspace.get(), ws, stream.get());
                });
                std::vector<DeviceBuffer> quantized;
                for (size_t i = 0; i < n_sets; ++i) {
                  quantized.emplace_back(ws);
                  quantize_kv(args[i], quantized.back().get(), ws, stream.get());
                }
                kernel_ms = median_ms(c, stream.get(), [&](int64_t i) {
                  attention_from_quantized_kv(args[i % n_sets], quantized[i % n_sets].get(), ws,
                                              stream.get());
                });
              }
              const double t = tops(c, batch, n, d, causal, med);
              const double ratio = static_cast<double>(ws) / static_cast<double>(qkv_bytes);
              std::vector<std::string> row = head;
              row.insert(row.end(), {std::to_string(copies), fixed(med, 3), fixed(t, 1),
                                     fixed(ratio, 3)});
              if (c.split)
                row.insert(row.end(), {fixed(prepass_ms, 3), fixed(kernel_ms, 3),
                                       fixed(tops(c, batch, n, d, causal, kernel_ms), 1)});
              rows[ri].push_back(row);
              ++timed[ri];
              rec.num("ms", med).num("tops", t).str("device", device)
                  .integer("workspace_bytes", static_cast<int64_t>(ws))
                  .integer("qkv_bytes", static_cast<int64_t>(qkv_bytes))
                  .integer("copies", static_cast<int64_t>(copies)).integer("iters", c.iters)
                  .integer("warmup", c.warmup);
              if (c.split)
                rec.num("prepass_ms", prepass_ms).num("kernel_ms", kernel_ms);
            } catch (const sage::Error& e) {
              // Not timed, and said so: a recipe or shape this build cannot run.
              std::vector<std::string> row = head;
              row.push_back(std::string("unsupported on GPU: ") + e.what());
              rows[ri].push_back(row);
              refusals[ri].insert(e.what());
              rec.str("device", device).str("status", "unsupported").str("message", e.what());
              ++failures;
            }
            records.push_back(rec);
          }
        }
      }
  }
  for (size_t ri = 0; ri < c.recipes.size(); ++ri) {
    if (timed[ri] == 0 && refusals[ri].size() == 1 && rows[ri].size() > 1) {
      table.add({c.recipes[ri], join(c.dtypes, ","), "all", "all", "all", "all",
                 "unsupported on GPU: " + *refusals[ri].begin()});
      continue;
    }
    for (auto& row : rows[ri]) table.add(row);
  }
  std::cout << "\n";
  table.print(std::cout);
  std::cout << "\nTOPS = 4 * batch * heads * N^2 * d / time (halved for causal); heads = "
            << c.heads << ", batch = " << c.tokens << " / N.\n";
  if (c.window.given())
    std::cout << "With --window " << c.window.text() << ", N^2 is the number of query-key pairs "
              << "the mask leaves visible: only the unmasked work counts.\n";
  if (!c.json.empty()) {
    JsonRecord meta;
    meta.str("tool", "sage bench").str("device", device).str("build", build_description())
        .str("timing", "whole call, median of CUDA-event timings after warm-up")
        .integer("tokens", c.tokens).integer("iters", c.iters).integer("warmup", c.warmup)
        .str("order", c.order).integer("items_per_cta", c.items_per_cta);
    write_json_file("sage bench", c.json, meta, records);
    std::cout << "wrote " << records.size() << " records to " << c.json << "\n";
  }
  if (failures)
    std::cout << failures << " point(s) were not timed: the recipe or shape is unsupported on "
              << "this GPU build (see the table).\n";
  return 0;
}

#endif  // SAGE_WITH_CUDA

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  std::vector<std::string> names;
  for (const Recipe& r : presets()) names.push_back(r.name);
  Flags flags(
      "sage bench",
      "Times sage::attention() on the GPU over the benchmark grid of DESIGN.md: whole call\n"
      "(quantization included), median of CUDA-event timings after warm-up, inputs rotated\n"
      "over enough copies to exceed L2. TOPS = 4*B*H*N*N*d/time, halved for causal; with\n"
      "--window, N*N is the number of visible query-key pairs (only unmasked work counts).\n"
      "Needs a CUDA build and a GPU of compute capability 9.0; exits 2 without one.",
      {{"recipe", "NAME[,NAME..]|all", "presets to time (default sage2_8b)"},
       {"d", "LIST", "head dims, comma-separated (default: the kernel tiles this build has, e.g. 64,96,128; any head dim the GPU takes, e.g. 80, runs zero-padded on the next tile)"},
       {"causal", "no|yes|both", "causal masking (default both)"},
       {"window", "LEFT,RIGHT", "a sliding window at every point: query i sees keys i - LEFT .. "
                                "i + RIGHT, -1 for an unbounded side (with causal, RIGHT -1 or "
                                "0); e.g. --causal yes --window 4096,0"},
       {"n", "LIST", "sequence lengths (default 1K,2K,4K,8K,16K,32K)"},
       {"heads", "H", "query heads (default 32)"},
       {"kv-heads", "H", "key/value heads, dividing --heads (default: --heads)"},
       {"tokens", "T", "batch = T / N (default 32K)"},
       {"dtype", "fp16|bf16|both", "input dtype (default fp16)"},
       {"warmup", "W", "untimed calls before timing each point (default 5)"},
       {"iters", "I", "timed calls per point; the median is reported (default 30)"},
       {"split", "", "also time the two steps alone: the K/V pre-pass and the attention kernel"},
       {"k-mean-stride", "S",
        "take K smoothing's mean over every S-th key instead of each preset's stride (recipes "
        "that smooth K)"},
       {"order", "auto|consecutive|grouped|strided",
        "force the forward's work order for every launch (default auto: the library's choice; "
        "docs/design.md, chained work items)"},
       {"items-per-cta", "N", "force N work items per CTA (default 0: the library's choice)"},
       {"json", "FILE", "also write every point as a JSON record"}},
      args);
  if (flags.help()) {
    flags.print_help(std::cout);
    return 0;
  }
  BenchConfig c;
  c.recipes = flags.choices("recipe", "sage2_8b", names);
  c.dims = flags.integers("d", gpu_kernel_head_dim_list(), 1, 1024);  // the kernel tiles; -d takes any
  const std::string causal = flags.choice("causal", "both", {"no", "yes", "both"});
  c.causal = causal == "both" ? std::vector<std::string>{"no", "yes"}
                              : std::vector<std::string>{causal};
  c.window = window_flag(flags, "sage bench", causal != "no");
  c.ns = flags.integers("n", {1024, 2048, 4096, 8192, 16384, 32768}, 1, int64_t(1) << 22);
  c.heads = flags.integer("heads", 32, 1, 4096);
  c.kv_heads = flags.integer("kv-heads", c.heads, 1, c.heads);
  if (c.heads % c.kv_heads != 0)
    throw UsageError("sage bench: --kv-heads must divide --heads (got " +
                     std::to_string(c.kv_heads) + " and " + std::to_string(c.heads) + ")");
  c.tokens = flags.integer("tokens", 32768, 1, int64_t(1) << 26);
  c.split = flags.has("split");
  if (flags.has("k-mean-stride")) {
    c.k_mean_stride = flags.integer("k-mean-stride", 0, 1, int64_t(1) << 20);
    for (const std::string& rn : c.recipes) {  // usage errors before any work
      Recipe r = preset(rn);
      apply_k_mean_stride("sage bench", r, c.k_mean_stride);
    }
  }
  const std::string dtype = flags.choice("dtype", "fp16", {"fp16", "bf16", "both"});
  c.dtypes = dtype == "both" ? std::vector<std::string>{"fp16", "bf16"}
                             : std::vector<std::string>{dtype};
  c.warmup = flags.integer("warmup", 5, 0, 10000);
  c.iters = flags.integer("iters", 30, 1, 100000);
  c.order = flags.choice("order", "auto", {"auto", "consecutive", "grouped", "strided"});
  c.items_per_cta = flags.integer("items-per-cta", 0, 0, 1 << 20);
  c.json = flags.str("json", "");
  if (flags.has("json") && c.json.empty())
    throw UsageError("sage bench: --json needs a file name");

  if (!gpu_available()) {
    std::cerr << "sage bench: no CUDA GPU of compute capability 9.0 found (this build: "
              << build_description() << "); nothing was timed\n";
    return 2;
  }
#ifdef SAGE_WITH_CUDA
  if (!c.json.empty()) check_writable("sage bench", "json", c.json);
  return run_grid(c);
#else
  return 2;  // unreachable: gpu_available() is false without CUDA
#endif
}

}  // namespace sage::cli
