// Checks exp2_fma (flash_fwd/exp2_fma.h) on the GPU against exp2 in double: every float32 in
// [-130, 10] with a stride of 1/4096 plus the edge values (-inf, -127, NaN). Prints the largest
// relative error where 2^x is a normal float; fails on a larger one, on a result below 2^-125
// that is not a nonnegative denormal (or not exactly +0 at or below -127), and on NaN not kept.
// Built and run by tests/test_gpu_exp2_fma.py
// (nvcc -std=c++17 -O3 -arch=sm_90a --use_fast_math -I cuda tests/cuda/check_exp2_fma.cu).
#include <cmath>
#include <cstdio>
#include <vector>

#include "flash_fwd/exp2_fma.h"

#define CHECK(call)                                                                   \
  do {                                                                                \
    const cudaError_t err = (call);                                                   \
    if (err != cudaSuccess) {                                                         \
      std::printf("%s: %s: FAILED\n", #call, cudaGetErrorString(err));               \
      return 2;                                                                       \
    }                                                                                 \
  } while (0)

__global__ void eval_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = jax_fa3::fwd::exp2_fma(x[i]);
}

int main() {
  std::vector<float> x;
  for (double v = -130.0; v <= 10.0; v += 1.0 / 4096) x.push_back(float(v));
  const float edges[] = {-INFINITY, -127.f, -126.99f, -126.5f, -126.f, 0.f, -0.5f, 0.5f, 8.f, NAN};
  for (float e : edges) x.push_back(e);
  const int n = int(x.size());
  float *dx = nullptr, *dy = nullptr;
  std::vector<float> y(n);
  CHECK(cudaMalloc(&dx, n * 4));
  CHECK(cudaMalloc(&dy, n * 4));
  CHECK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
  eval_kernel<<<(n + 255) / 256, 256>>>(dx, dy, n);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(y.data(), dy, n * 4, cudaMemcpyDeviceToHost));
  double max_rel = 0;
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const double ref = std::exp2(double(x[i]));
    if (std::isnan(x[i])) {
      bad += !std::isnan(y[i]);
    } else if (ref >= 0x1p-125) {
      max_rel = std::fmax(max_rel, std::fabs(y[i] / ref - 1));
    } else {
      // Below the normal range the result must be +0 or a nonnegative denormal (FTZ'd later);
      // at or below -127 (masked scores: -inf) exactly +0.
      bad += !(y[i] >= 0.f && y[i] < 0x1p-125f) || (x[i] <= -127.f && y[i] != 0.f);
    }
  }
  const bool ok = bad == 0 && max_rel < 2e-4;
  std::printf("exp2_fma: %d values, max relative error %.3e (normal range), %d bad: %s\n", n,
              max_rel, bad, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
