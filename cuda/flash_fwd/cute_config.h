// Must precede every CuTe include of the forward kernel: enables the wgmma shapes whose N is not
// a multiple of 16 or 32 (kBlockN 80, 112, 144, 176 are N of the S = QK^T GEMM). Without it the
// op selector silently falls back to N = 16 atoms, re-reading Q from shared memory per 16 columns.
#pragma once
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
