// Standalone timing and per-warpgroup timeline of the fp8 forward kernel (with -DTOOL_BF16 the bf16
// one), without JAX: random inputs (fp8: N(0, 1) quantized as the library does), median kernel
// time over many launches (cudaEvents), and with -DJAX_FA3_FWD_TRACE the clock64 stamps of trace.h
// summarised per main-loop phase. Not part of the build; run:
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr --use_fast_math -I cuda -isystem <cutlass>/include \
//        [-DJAX_FA3_FWD_TRACE] [-DTOOL_BF16] -DTOOL_HDIM=128 [-DTOOL_BLOCK_M=128] \
//        cuda/flash_fwd/tools/fwd_timeline.cu -o fwd_timeline
//   ./fwd_timeline [batch heads seqlen causal [quick]]  (default 2 16 8192 0: 16k tokens, d128
//   width 2048; quick: 3 launches, for compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// The library's bucket macros (the workspace sizing asks which bucket runs d): this tool's only.
#if !defined(TOOL_HDIM) || TOOL_HDIM == 128
#define JAX_FA3_HAS_HDIM128
#elif TOOL_HDIM == 64
#define JAX_FA3_HAS_HDIM64
#elif TOOL_HDIM == 256
#define JAX_FA3_HAS_HDIM256
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "flash_fwd/fp8/launch.h"
#include "flash_fwd/launch.h"

#ifndef TOOL_HDIM
#define TOOL_HDIM 128
#endif
// fp8: rows per tile; the library picks d128's per call (fp8/flash_fwd_fp8.h, fp8_block_m), the
// tool times the one it was built with and says when the library would pick the other.
#ifndef TOOL_BLOCK_M
#define TOOL_BLOCK_M jax_fa3::fp8_default_block_m(TOOL_HDIM)
#endif
// fp8/flash_fwd_fp8.h / flash_fwd.h declare the instantiations extern; this tool compiles its own.
#ifdef TOOL_BF16
template cudaError_t jax_fa3::run_flash_fwd<TOOL_HDIM, jax_fa3::DType::kBFloat16>(
    const jax_fa3::FlashFwdParams&, cudaStream_t);
#else
template cudaError_t jax_fa3::run_flash_fwd_fp8<TOOL_HDIM, TOOL_BLOCK_M>(
    const jax_fa3::FlashFwdFp8Params&, cudaStream_t);
#endif

#define CHECK(call)                                                                     \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <class T>
T* upload(const std::vector<T>& host) {
  T* dev = nullptr;
  CHECK(cudaMalloc(&dev, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

std::vector<uint8_t> random_e4m3(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 64.f);  // spans e4m3's range like quantized data
  std::vector<uint8_t> out(n);
  for (auto& x : out) x = __nv_fp8_e4m3(normal(rng)).__x;
  return out;
}

// What the library feeds the kernel: N(0, 1) values quantized as jax_fa3.quantize_fp8 does, one
// scale per `block` tokens of a (batch, head) (amax * float32(1/448)), v with one scale per head.
// layout (b, s, h, d); scales (b, h, ceil(s / block)). The kernel's time depends on the data (H200,
// 2026-12-02: +1.3% on these inputs against random e4m3 values with random scales).
// centred_by (v): each (batch, head, dim)'s mean over the tokens, subtracted before quantizing
// (jax_fa3/_fp8_quantize.py, centre_v_kernel_layout), the kernel's v_mean.
std::vector<uint8_t> quantized_normal(int b, int s, int h, int d, int block, std::mt19937& rng,
                                      std::vector<float>& scales, float mean = 0.f,
                                      std::vector<float>* centred_by = nullptr) {
  std::normal_distribution<float> normal(mean, 1.f);
  std::vector<float> x(size_t(b) * s * h * d);
  for (auto& v : x) v = normal(rng);
  const int nb = (s + block - 1) / block;
  scales.assign(size_t(b) * h * nb, 1.f);
  std::vector<uint8_t> out(x.size());
  auto at = [&](int bi, int t, int hi) { return ((size_t(bi) * s + t) * h + hi) * d; };
  if (centred_by != nullptr) {
    centred_by->assign(size_t(b) * h * d, 0.f);
    for (int bi = 0; bi < b; ++bi)
      for (int hi = 0; hi < h; ++hi)
        for (int e = 0; e < d; ++e) {
          double sum = 0;
          for (int t = 0; t < s; ++t) sum += x[at(bi, t, hi) + e];
          const float m = float(sum / s);
          (*centred_by)[(size_t(bi) * h + hi) * d + e] = m;
          for (int t = 0; t < s; ++t) x[at(bi, t, hi) + e] -= m;
        }
  }
  for (int bi = 0; bi < b; ++bi)
    for (int hi = 0; hi < h; ++hi)
      for (int n = 0; n < nb; ++n) {
        const int t0 = n * block, t1 = std::min(s, t0 + block);
        float amax = 0.f;
        for (int t = t0; t < t1; ++t)
          for (int e = 0; e < d; ++e) amax = std::max(amax, std::fabs(x[at(bi, t, hi) + e]));
        const float scale = amax > 0.f ? std::max(amax * (1.f / 448.f), FLT_MIN) : 1.f;
        scales[(size_t(bi) * h + hi) * nb + n] = scale;
        const float inv = 1.f / scale;
        for (int t = t0; t < t1; ++t)
          for (int e = 0; e < d; ++e) {
            out[at(bi, t, hi) + e] = __nv_fp8_e4m3(x[at(bi, t, hi) + e] * inv).__x;
          }
      }
  return out;
}

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = __bfloat16_as_ushort(__float2bfloat16(normal(rng)));
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int b = argc > 1 ? std::atoi(argv[1]) : 2;
  const int h = argc > 2 ? std::atoi(argv[2]) : 16;
  const int s = argc > 3 ? std::atoi(argv[3]) : 8192;
  const bool causal = argc > 4 && std::atoi(argv[4]) != 0;
  const int d = TOOL_HDIM;
  std::mt19937 rng(0);
#ifdef TOOL_BF16
  const char* dtype_label = "bf16";
  jax_fa3::FlashFwdParams p{};
  auto random_input = random_bf16;
  CHECK(cudaMalloc(&p.o, size_t(b) * s * h * d * 2));
  CHECK(cudaMalloc(&p.lse, size_t(b) * h * s * 4));
  p.b = b; p.s_q = s; p.s_k = s; p.h = h; p.h_k = h; p.d = d;
  p.dtype = jax_fa3::DType::kBFloat16;
  p.softmax_scale = 1.f / std::sqrt(float(d));
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  auto launch = [&] {
    return jax_fa3::run_flash_fwd<TOOL_HDIM, jax_fa3::DType::kBFloat16>(p, nullptr);
  };
#else
  char dtype_label[64];
  std::snprintf(dtype_label, sizeof(dtype_label), "fp8 %d-row tiles (V pre-pass included)",
                int(TOOL_BLOCK_M));
  const int block_size = 64, nb = (s + block_size - 1) / block_size;
  std::vector<float> qs, ks, vs, v_mean(size_t(b) * h * d, 0.f);
  std::vector<uint8_t> hq, hk, hv;
  // TOOL_INPUTS=e4m3: random e4m3 values with random scales in [0.5, 1.5]/64.
  const char* inputs = std::getenv("TOOL_INPUTS");
  if (inputs != nullptr && std::string(inputs) == "e4m3") {
    std::uniform_real_distribution<float> uni(0.5f / 64, 1.5f / 64);
    qs.resize(size_t(b) * h * nb), ks.resize(size_t(b) * h * nb), vs.resize(size_t(b) * h);
    for (auto* v : {&qs, &ks, &vs}) for (auto& x : *v) x = uni(rng);
    for (auto* v : {&hq, &hk, &hv}) *v = random_e4m3(size_t(b) * s * h * d, rng);
    std::printf("inputs: random e4m3 values, random scales\n");
  } else {
    hq = quantized_normal(b, s, h, d, block_size, rng, qs);
    hk = quantized_normal(b, s, h, d, block_size, rng, ks);
    // TOOL_V_MEAN=m: v ~ N(m, 1), whose PV sums grow with the keys instead of cancelling (the
    // fp8 wgmma accumulates with ~13 mantissa bits: H200, 2026-12-03, benchmarks/RESULTS.md).
    // V is centred as the library does; TOOL_CENTRE_V=0 quantizes it as is (v_mean 0).
    const char* shift = std::getenv("TOOL_V_MEAN");
    const char* centre = std::getenv("TOOL_CENTRE_V");
    const bool centred = centre == nullptr || std::string(centre) != "0";
    hv = quantized_normal(b, s, h, d, s, rng, vs, shift != nullptr ? std::atof(shift) : 0.f,
                          centred ? &v_mean : nullptr);
    std::printf("inputs: N(0, 1) quantized as the library does (64-token blocks; v per head%s%s, "
                "%s)\n", shift != nullptr ? ", mean " : "", shift != nullptr ? shift : "",
                centred ? "centred" : "not centred");
  }

  jax_fa3::FlashFwdFp8Params p{};
  p.q_scale = upload(qs);
  p.k_scale = upload(ks);
  p.v_scale = upload(vs);
  p.v_mean = upload(v_mean);
  CHECK(cudaMalloc(&p.o, size_t(b) * s * h * d * 2));
  CHECK(cudaMalloc(&p.lse, size_t(b) * h * s * 4));
  const size_t workspace_bytes = jax_fa3::flash_fwd_fp8_workspace_bytes(b, s, s, h, h, d, causal,
                                                                      false);
  CHECK(cudaMalloc(&p.workspace, workspace_bytes));
  // Garbage, as XLA's scratch may hold: the kernel clears what it relies on (the tail split's
  // tickets) itself.
  CHECK(cudaMemset(p.workspace, 0xff, workspace_bytes));
  p.b = b; p.s_q = s; p.s_k = s; p.h = h; p.h_k = h; p.d = d;
  p.block_size = block_size;
  p.softmax_scale = 1.f / std::sqrt(float(d));
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;

  if (jax_fa3::fp8_block_m(TOOL_HDIM, p) != TOOL_BLOCK_M) {
    std::printf("note: %d-row tiles; the library runs this call with %d-row tiles\n", TOOL_BLOCK_M,
                jax_fa3::fp8_block_m(TOOL_HDIM, p));
  }
  auto launch = [&] { return jax_fa3::run_flash_fwd_fp8<TOOL_HDIM, TOOL_BLOCK_M>(p, nullptr); };
#endif
#ifdef TOOL_BF16
  const auto hq = random_input(size_t(b) * s * h * d, rng);
  const auto hk = random_input(size_t(b) * s * h * d, rng);
  const auto hv = random_input(size_t(b) * s * h * d, rng);
#endif
  p.q = upload(hq);
  p.k = upload(hk);
  p.v = upload(hv);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const double flops = 4.0 * b * h * double(s) * s * d * (causal ? 0.5 : 1.0);
  // A 5th argument "1" (quick) launches 3 times in all: for compute-sanitizer, whose racecheck of
  // the whole kernel is too slow for 240 launches; the timing it prints then means nothing.
  const bool quick = argc > 5 && std::atoi(argv[5]) != 0;
  auto time_launches = [&](const char* label) {
    std::vector<double> ms_per_launch;
    for (int rep = 0; rep < (quick ? 3 : 12); ++rep) {
      const int launches = quick ? 1 : 20;
      CHECK(cudaEventRecord(start));
      for (int i = 0; i < launches; ++i) CHECK(launch());
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (rep > 1) ms_per_launch.push_back(ms / launches);
    }
    const double ms = median(ms_per_launch);
    std::printf("%s d=%d b=%d h=%d s=%d%s: %.3f ms, %.0f TFLOP/s\n", label, d, b, h, s,
                causal ? " causal" : "", ms, flops / ms / 1e9);
  };
  time_launches(dtype_label);

  // Spot check against a float64 reference on the same (quantized) inputs: a few rows of O. The
  // fp8 kernel's P is e4m3 (~3% relative error per row); a layout or race bug gives O(1).
  // row_error: the relative error of one output row (b, head, row) of `ho` against float64.
  std::vector<double> sc(s), o_ref(d);
  auto row_error = [&](const std::vector<uint16_t>& ho, int bi, int hi, int row) {
#ifdef TOOL_BF16
    auto val = [&](const std::vector<uint16_t>& x, size_t i) {
      return double(__bfloat162float(__ushort_as_bfloat16(x[i])));
    };
    auto qv = [&](int, int, int, size_t i) { return val(hq, i); };
    auto kv = [&](int, int, int, size_t i) { return val(hk, i); };
    auto vv = [&](int, int, size_t i) { return val(hv, i); };
#else
    auto e4m3 = [](uint8_t x) {
      __nv_fp8_e4m3 f;
      f.__x = x;
      return double(float(f));
    };
    auto qv = [&](int bi, int hi, int row, size_t i) {
      return e4m3(hq[i]) * qs[(size_t(bi) * h + hi) * nb + row / block_size];
    };
    auto kv = [&](int bi, int hi, int row, size_t i) {
      return e4m3(hk[i]) * ks[(size_t(bi) * h + hi) * nb + row / block_size];
    };
    auto vv = [&](int bi, int hi, size_t i) {
      return e4m3(hv[i]) * vs[size_t(bi) * h + hi] + v_mean[(size_t(bi) * h + hi) * d + i % d];
    };
#endif
    const int last = causal ? row : s - 1;
    double mx = -1e300;
    for (int j = 0; j <= last; ++j) {
      double dot = 0;
      for (int e = 0; e < d; ++e) {
        const size_t iq = ((size_t(bi) * s + row) * h + hi) * d + e;
        const size_t ik = ((size_t(bi) * s + j) * h + hi) * d + e;
        dot += qv(bi, hi, row, iq) * kv(bi, hi, j, ik);
      }
      sc[j] = dot * p.softmax_scale;
      mx = std::max(mx, sc[j]);
    }
    double sum = 0;
    std::fill(o_ref.begin(), o_ref.end(), 0.0);
    for (int j = 0; j <= last; ++j) {
      const double w = std::exp(sc[j] - mx);
      sum += w;
      for (int e = 0; e < d; ++e) o_ref[e] += w * vv(bi, hi, ((size_t(bi) * s + j) * h + hi) * d + e);
    }
    double err2 = 0, ref2 = 0;
    for (int e = 0; e < d; ++e) {
      const double ref = o_ref[e] / sum;
      const double got = double(__bfloat162float(
          __ushort_as_bfloat16(ho[((size_t(bi) * s + row) * h + hi) * d + e])));
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  };
#ifdef TOOL_BF16
  const double tol = 0.01;
#else
  const double tol = 0.1;
#endif
  auto check_output = [&] {
    std::vector<uint16_t> ho(size_t(b) * s * h * d);
    CHECK(cudaMemcpy(ho.data(), p.o, ho.size() * 2, cudaMemcpyDeviceToHost));
    double worst = 0;
    std::uniform_int_distribution<int> pick_b(0, b - 1), pick_h(0, h - 1), pick_row(0, s - 1);
    const int kRows = 24;
    for (int t = 0; t < kRows; ++t) {
      // Every 4th row from the last (batch, head): the last tiles, split in two pieces where the
      // last round is short (fp8/tail_split.h).
      const bool last_tiles = t % 4 == 1;
      const int bi = last_tiles ? b - 1 : pick_b(rng), hi = last_tiles ? h - 1 : pick_h(rng);
      const int row = t == 0 ? s - 1 : pick_row(rng);
      worst = std::max(worst, row_error(ho, bi, hi, row));
    }
    std::printf("check: max relative row error %.3g over %d rows (limit %.2g)%s\n", worst, kRows,
                tol, worst <= tol ? "" : "  FAILED");
  };
  check_output();
#ifndef TOOL_BF16
  // Again with V handed over already transposed (what the rotate + quantize pass's keys-transposed
  // mode gives the library): the pre-pass's last output becomes the input, only k_col is expanded.
  {
    const size_t vt_bytes = size_t(b) * h * d * jax_fa3::flash_fwd_fp8_key_pad(s);
    void* vt = nullptr;
    CHECK(cudaMalloc(&vt, vt_bytes));
    CHECK(cudaMemcpy(vt, p.workspace, vt_bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemset(p.o, 0xff, size_t(b) * s * h * d * 2));  // NaN: the check sees unwritten rows
    p.v = vt;
    p.v_transposed = true;
    char label[96];
    std::snprintf(label, sizeof(label), "fp8 %d-row tiles (V given transposed)", int(TOOL_BLOCK_M));
    time_launches(label);
    check_output();

    // The same without the tail split. Its pieces quantize P as the whole tile does, but the fp8
    // tensor cores accumulate O with ~14 bits relative to the running sum, so accumulating the low
    // blocks from zero instead of on top of the high ones moves outputs by a few bf16 steps (H200,
    // 2026-12-02: 1.2% of d128 8k outputs differ, 449 by more than one step). The check:
    // on the row where the two differ most, the split output is as close to float64 as the whole.
    const size_t n_out = size_t(b) * s * h * d;
    std::vector<uint16_t> split_out(n_out), whole_out(n_out);
    CHECK(cudaMemcpy(split_out.data(), p.o, n_out * 2, cudaMemcpyDeviceToHost));
    p.tail_split = false;
    std::snprintf(label, sizeof(label), "fp8 %d-row tiles (V transposed, no tail split)",
                  int(TOOL_BLOCK_M));
    time_launches(label);
    CHECK(cudaMemcpy(whole_out.data(), p.o, n_out * 2, cudaMemcpyDeviceToHost));
    auto value = [](uint16_t x) { return double(__bfloat162float(__ushort_as_bfloat16(x))); };
    double sum_sq = 0;
    for (size_t i = 0; i < n_out; ++i) sum_sq += value(whole_out[i]) * value(whole_out[i]);
    const double rms = std::sqrt(sum_sq / double(n_out));
    // Counted: differences past one bf16 step (2^-8 relative, 2^-7 counted generously, plus 2^-8
    // of the RMS for outputs near zero).
    size_t differ = 0, bad = 0, worst_at = 0;
    double max_diff = 0;
    for (size_t i = 0; i < n_out; ++i) {
      const double x = value(split_out[i]), y = value(whole_out[i]);
      differ += split_out[i] != whole_out[i];
      if (std::fabs(x - y) > max_diff) max_diff = std::fabs(x - y), worst_at = i;
      bad += !(std::fabs(x - y) <= std::fabs(y) / 128 + rms / 256);
    }
    // The row of the largest difference against float64, split and whole.
    const size_t row_index = worst_at / d;  // (b, s, h) order
    const int wh = int(row_index % h), wrow = int(row_index / h % s), wb = int(row_index / h / s);
    const double split_err = row_error(split_out, wb, wh, wrow);
    const double whole_err = row_error(whole_out, wb, wh, wrow);
    std::printf("tail split vs whole tiles: %zu of %zu outputs differ, max |diff| %.3g (output rms "
                "%.3g), %zu past one bf16 step; that row (b %d, head %d, row %d) vs float64: "
                "split %.4g, whole %.4g%s\n", differ, n_out, max_diff, rms, bad, wb, wh, wrow,
                split_err, whole_err, split_err <= 1.5 * whole_err + 5e-3 ? "" : "  FAILED");
    // Alternating repeats: between runs the GPU's clock moves by about as much as the split gains
    // (H200, 2026-12-02: the same unsplit kernel at 852-866 TFLOP/s in three processes).
    for (int rep = 0; !quick && rep < 3; ++rep) {
      p.tail_split = true;
      time_launches("  again, tail split");
      p.tail_split = false;
      time_launches("  again, whole tiles");
    }
  }
#endif

#ifdef JAX_FA3_FWD_TRACE
  using namespace jax_fa3::fwd;
  std::vector<long long> tr(size_t(kTraceCtas) * kTraceWarpGroups * kTraceSteps * kTraceEvents);
  CHECK(cudaMemcpyFromSymbol(tr.data(), g_fwd_trace, tr.size() * sizeof(long long)));
  auto at = [&](int cta, int wg, int step, int ev) {
    return tr[((size_t(cta) * kTraceWarpGroups + wg) * kTraceSteps + step) * kTraceEvents + ev];
  };
  const char* names[] = {"kv wait", "turn wait", "issue", "S wait", "max", "exp", "PV wait",
                         "rescale+cvt", "to next"};
  // Per phase: cycles from event e to e+1 (the last: to the next block's start), median over the
  // steady-state blocks of the traced CTAs (a tile's first block has no stamps; steps whose next
  // stamp is from another tile are dropped by the 4000-cycle cut). Only the intra-warpgroup
  // overlap loop is stamped: kernels without it (3 warpgroups, d256) print 0 for those phases.
  for (int wg = 0; wg < kTraceWarpGroups; ++wg) {
    std::printf("wg%d:", wg);
    double total = 0;
    for (int e = 0; e < kTraceEvents; ++e) {
      std::vector<double> d_e;
      for (int cta = 0; cta < kTraceCtas; ++cta)
        for (int st = 8; st + 1 < kTraceSteps; ++st) {
          const long long a = at(cta, wg, st, e);
          const long long z = e + 1 < kTraceEvents ? at(cta, wg, st, e + 1) : at(cta, wg, st + 1, 0);
          if (a && z && z > a && z - a < 4000) d_e.push_back(double(z - a));
        }
      total += median(d_e);
      std::printf("  %s %.0f", names[e], median(d_e));
    }
    std::printf("  | sum %.0f cycles\n", total);
  }
  std::printf("CTA 0 timeline (cycles from wg0's first stamp), steps 20..27:\n");
  const long long t0 = at(0, 0, 20, 0);
  for (int st = 20; st < 28; ++st)
    for (int wg = 0; wg < kTraceWarpGroups; ++wg) {
      std::printf("  step %d wg%d:", st, wg);
      for (int e = 0; e < kTraceEvents; ++e) std::printf(" %6lld", at(0, wg, st, e) - t0);
      std::printf("\n");
    }
#endif
  return 0;
}
