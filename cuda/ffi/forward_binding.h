// The results and attributes every 16-bit forward handler binds after its operands (q, k, v, then
// the key operands, pages or scales of its kind): out, lse, then the attention's scalars.
#pragma once
#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_fa3::ffi_util {

template <class Binding>
auto bind_fwd_results_and_attrs(Binding inputs) {
  namespace ffi = xla::ffi;
  return std::move(inputs).template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

}  // namespace jax_fa3::ffi_util
