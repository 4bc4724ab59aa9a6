// Standalone timing of the fused rotate + quantize pass (quantize/rotate_quantize.cu), no JAX:
// the pass's variants are compared here, beside a plain bf16 -> e4m3 cast with the same traffic
// (the memory-bound floor). Build (from the repo root):
//   nvcc -std=c++17 -O3 -arch=sm_90a --use_fast_math -I cuda \
//     cuda/quantize/tools/rotate_quantize_timing.cu -o rq_timing
// Run: rq_timing b s h d [quick]  (bf16 input; prints q/k rotated per 64-token block, v per head as
// is, in the fp8 kernel's V layout, and centred by the pass into that layout (what
// `flash_attention_fp8` from floats runs), and the cast floor; µs and GB/s of the minimum traffic,
// 3 bytes per element; each case's output hash, to compare two builds bit for bit; then a host
// check of the uncentred v cases, "FAILED" if it does not hold).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "quantize/rotate_quantize.cu"

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// 16 bytes of bf16 in, 8 bytes of e4m3 out per thread: what any pass over x must at least move.
__global__ void cast_floor_kernel(const uint4* __restrict__ x, uint2* __restrict__ y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint4 raw = x[i];
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  uint32_t out[2];
  for (int w = 0; w < 2; ++w) {
    const float2 a = __bfloat1622float2(pairs[2 * w]);
    const float2 b = __bfloat1622float2(pairs[2 * w + 1]);
    out[w] = jax_fa3::e4m3x2(a.x, a.y) | (jax_fa3::e4m3x2(b.x, b.y) << 16);
  }
  y[i] = make_uint2(out[0], out[1]);
}

int main(int argc, char** argv) {
  const int64_t b = argc > 1 ? std::atoll(argv[1]) : 2;
  const int64_t s = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int64_t h = argc > 3 ? std::atoll(argv[3]) : 16;
  const int d = argc > 4 ? std::atoi(argv[4]) : 128;
  const int64_t n = b * s * h * d;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<__nv_bfloat16> hx(n);
  for (auto& v : hx) v = __float2bfloat16(normal(rng));
  std::vector<float> hsigns(d);
  for (auto& v : hsigns) v = (rng() & 1) ? 1.f : -1.f;
  void *x, *values;
  float *signs, *scales, *mean_out, *partials;
  CHECK(cudaMalloc(&x, n * 2));
  CHECK(cudaMalloc(&mean_out, b * h * d * 4));
  CHECK(cudaMalloc(&partials, jax_fa3::rotate_quantize_centre_workspace_floats(b, s, h, d) * 4));
  CHECK(cudaMalloc(&values, b * h * d * jax_fa3::flash_fwd_fp8_key_pad(s)));
  CHECK(cudaMalloc(&signs, d * 4));
  CHECK(cudaMalloc(&scales, b * h * ((s + 63) / 64) * 4));
  CHECK(cudaMemcpy(x, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(signs, hsigns.data(), d * 4, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // A 5th argument "1" (quick): one launch per case, for compute-sanitizer (its timing means
  // nothing then).
  const bool quick = argc > 5 && std::atoi(argv[5]) != 0;
  auto time_us = [&](auto&& launch) {
    std::vector<float> per_launch;
    for (int rep = 0; rep < (quick ? 3 : 12); ++rep) {
      CHECK(cudaEventRecord(start));
      const int launches = quick ? 1 : 20;
      for (int i = 0; i < launches; ++i) launch();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (rep > 1) per_launch.push_back(ms * 1e3f / launches);
    }
    std::sort(per_launch.begin(), per_launch.end());
    return per_launch[per_launch.size() / 2];
  };
  auto report = [&](const char* what, float us) {
    std::printf("%-28s b=%lld s=%lld h=%lld d=%d: %7.1f us %6.0f GB/s\n", what, (long long)b,
                (long long)s, (long long)h, d, us, 3.0 * n / us / 1e3);
  };
  struct Case {
    const char* name;
    bool rotate;
    int block_size;  // 0: one block per head
    bool keys_transposed;
    bool centre;
  };
  // Check of the unrotated cases against the host: v's per-head scales exactly, its values at
  // every 97th element (e4m3 of x times the correctly rounded reciprocal), and the kernel layout
  // against the plain layout (permutation and zero padding). The rotated pass is checked against
  // the pure-JAX path by tests/test_gpu_rotate_quantize.py.
  std::vector<uint8_t> plain(n);
  bool ok = true;
  auto check_v = [&](bool keys_transposed) {
    std::vector<float> hscales(b * h);
    CHECK(cudaMemcpy(hscales.data(), scales, hscales.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t bh = 0; bh < b * h; ++bh) {
      float amax = 0.f;
      for (int64_t t = 0; t < s; ++t)
        for (int e = 0; e < d; ++e)
          amax = std::max(amax, std::fabs(__bfloat162float(hx[(((bh / h) * s + t) * h + bh % h) * d + e])));
      ok &= hscales[bh] == std::max(amax * (1.f / 448.f), FLT_MIN);
    }
    if (!keys_transposed) {
      CHECK(cudaMemcpy(plain.data(), values, n, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < n; i += 97) {
        const int64_t bh = (i / (int64_t(d) * h * s)) * h + (i / d) % h;
        const float inv = 1.f / hscales[bh];  // host division: IEEE, correctly rounded
        ok &= plain[i] == __nv_fp8_e4m3(__bfloat162float(hx[i]) * inv).__x;
      }
      return;
    }
    const int64_t s_pad = jax_fa3::flash_fwd_fp8_key_pad(s);
    std::vector<uint8_t> vt(b * h * d * s_pad);
    CHECK(cudaMemcpy(vt.data(), values, vt.size(), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < int64_t(vt.size()); ++i) {
      const int64_t slot = i % s_pad, dim = (i / s_pad) % d, bh = i / (s_pad * d);
      const int64_t key = slot / 32 * 32 + jax_fa3::fp8::fp8_key_of_slot(slot % 32);
      const uint8_t want = key < s ? plain[(((bh / h) * s + key) * h + bh % h) * d + dim] : 0;
      ok &= vt[i] == want;
    }
  };
  for (const Case& c : {Case{"q/k rotated, 64-token blocks", true, 64, false, false},
                        Case{"v per head", false, 0, false, false},
                        Case{"v per head, kernel layout", false, 0, true, false},
                        Case{"v centred, kernel layout", false, 0, true, true}}) {
    jax_fa3::RotateQuantizeParams p{x, c.rotate ? signs : nullptr, values, scales, b, s, h, d,
                                    c.block_size ? c.block_size : static_cast<int>(s),
                                    jax_fa3::DType::kBFloat16, c.keys_transposed};
    if (c.centre) {
      p.mean_out = mean_out;
      p.partials = partials;
    }
    report(c.name, time_us([&] { CHECK(jax_fa3::launch_rotate_quantize(p, nullptr)); }));
    if (!c.rotate && !c.centre) check_v(c.keys_transposed);
    // FNV-1a of the values, the scales and the mean: two builds of the pass compare bit for bit.
    const int64_t value_bytes =
        c.keys_transposed ? b * h * d * jax_fa3::flash_fwd_fp8_key_pad(s) : n;
    const int64_t blocks = c.block_size ? (s + c.block_size - 1) / c.block_size : 1;
    std::vector<uint8_t> out(value_bytes);
    std::vector<uint32_t> out_scales(b * h * blocks);
    std::vector<uint32_t> out_mean(c.centre ? b * h * d : 0);
    CHECK(cudaMemcpy(out.data(), values, out.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(out_scales.data(), scales, out_scales.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(out_mean.data(), mean_out, out_mean.size() * 4, cudaMemcpyDeviceToHost));
    uint64_t hash = 1469598103934665603ull;
    for (uint8_t byte : out) hash = (hash ^ byte) * 1099511628211ull;
    for (uint32_t word : out_scales) hash = (hash ^ word) * 1099511628211ull;
    for (uint32_t word : out_mean) hash = (hash ^ word) * 1099511628211ull;
    std::printf("  hash of the values, scales and mean: %016llx\n", (unsigned long long)hash);
  }
  std::printf("check: v scales, values and kernel layout vs host: %s\n", ok ? "ok" : "FAILED");
  const int64_t vecs = n / 8;
  report("cast floor (bf16 -> e4m3)", time_us([&] {
           cast_floor_kernel<<<(vecs + 255) / 256, 256>>>(static_cast<const uint4*>(x),
                                                          static_cast<uint2*>(values), vecs);
           CHECK(cudaGetLastError());
         }));
  return ok ? 0 : 1;
}
