// Every XLA FFI handler the kernels library exports, and the registry Python reads.
#pragma once
#include "common/cuda_check.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3Hadamard);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwdKeyRanges);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwdPaged);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwdRowBounds);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwdPagedRowBounds);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashBwdKeyRanges);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashBwdFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3FlashFwdFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3RotateQuantizeFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa3SplitKvCombine);
