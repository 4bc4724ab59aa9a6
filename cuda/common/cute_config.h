// Must precede every CuTe include of the kernels: enables the wgmma shapes whose N is not a
// multiple of 16 or 32 (the forward's kBlockN 80, 112, 144, 176 are N of S = QK^T; the
// backward's 80-row Q blocks are N of S^T and dQ^T). Without it the op selector silently falls
// back to N = 16 atoms, re-reading the A operand from shared memory per 16 columns.
#pragma once
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
