#include "ffi/registry.h"

#include "ffi/handlers.h"

#define JAX_FA3_STR2(x) #x
#define JAX_FA3_STR(x) JAX_FA3_STR2(x)

extern "C" const jax_fa3::FfiTarget* jax_fa3_ffi_targets(int* count) {
  static const jax_fa3::FfiTarget targets[] = {
      {"jax_fa3_hadamard", reinterpret_cast<void*>(JaxFa3Hadamard)},
      {"jax_fa3_flash_fwd", reinterpret_cast<void*>(JaxFa3FlashFwd)},
      {"jax_fa3_flash_bwd", reinterpret_cast<void*>(JaxFa3FlashBwd)},
      {"jax_fa3_flash_fwd_key_ranges", reinterpret_cast<void*>(JaxFa3FlashFwdKeyRanges)},
      {"jax_fa3_flash_fwd_paged", reinterpret_cast<void*>(JaxFa3FlashFwdPaged)},
      {"jax_fa3_flash_fwd_row_bounds", reinterpret_cast<void*>(JaxFa3FlashFwdRowBounds)},
      {"jax_fa3_flash_fwd_paged_row_bounds",
       reinterpret_cast<void*>(JaxFa3FlashFwdPagedRowBounds)},
      {"jax_fa3_flash_fwd_decode", reinterpret_cast<void*>(JaxFa3FlashFwdDecode)},
      {"jax_fa3_flash_fwd_paged_decode", reinterpret_cast<void*>(JaxFa3FlashFwdPagedDecode)},
      {"jax_fa3_flash_fwd_decode_fp8_cache",
       reinterpret_cast<void*>(JaxFa3FlashFwdDecodeFp8Cache)},
      {"jax_fa3_flash_fwd_paged_decode_fp8_cache",
       reinterpret_cast<void*>(JaxFa3FlashFwdPagedDecodeFp8Cache)},
      {"jax_fa3_flash_bwd_key_ranges", reinterpret_cast<void*>(JaxFa3FlashBwdKeyRanges)},
      {"jax_fa3_flash_fwd_fp8", reinterpret_cast<void*>(JaxFa3FlashFwdFp8)},
      {"jax_fa3_flash_bwd_fp8", reinterpret_cast<void*>(JaxFa3FlashBwdFp8)},
      {"jax_fa3_rotate_quantize_fp8", reinterpret_cast<void*>(JaxFa3RotateQuantizeFp8)},
      {"jax_fa3_split_kv_combine", reinterpret_cast<void*>(JaxFa3SplitKvCombine)},
  };
  *count = static_cast<int>(sizeof(targets) / sizeof(targets[0]));
  return targets;
}

extern "C" const char* jax_fa3_build_config() {
  return "head_dims="
#ifdef JAX_FA3_HAS_HDIM64
         "64,"
#endif
#ifdef JAX_FA3_HAS_HDIM96
         "96,"
#endif
#ifdef JAX_FA3_HAS_HDIM128
         "128,"
#endif
#ifdef JAX_FA3_HAS_HDIM192
         "192,"
#endif
#ifdef JAX_FA3_HAS_HDIM256
         "256,"
#endif
         ";dtypes="
#ifdef JAX_FA3_HAS_BF16
         "bf16,"
#endif
#ifdef JAX_FA3_HAS_FP16
         "fp16,"
#endif
         ";cuda=" JAX_FA3_STR(CUDART_VERSION);
}
