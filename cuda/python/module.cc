// nanobind module: hands Python one PyCapsule per XLA FFI handler. Nothing else lives here.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/registry.h"

namespace nb = nanobind;

NB_MODULE(_jax_fa3_cuda, m) {
  m.doc() = "jax_fa3 compiled extension: XLA FFI handlers for the sm_90a kernels";
  m.def("ffi_targets", []() {
    nb::dict out;
    int count = 0;
    const jax_fa3::FfiTarget* targets = jax_fa3_ffi_targets(&count);
    for (int i = 0; i < count; ++i) out[targets[i].name] = nb::capsule(targets[i].handler);
    return out;
  }, "Mapping from FFI target name to its handler capsule (platform CUDA, api_version 1).");
  m.def("build_config", []() { return std::string(jax_fa3_build_config()); });
  m.def("flash_bwd_workspace_bytes", &jax_fa3_flash_bwd_workspace_bytes, nb::arg("batch"),
        nb::arg("heads"), nb::arg("seqlen_q"), nb::arg("head_dim"), nb::arg("deterministic"),
        "Size of the uint8 workspace result of jax_fa3_flash_bwd.");
  m.def("flash_bwd_fp8_workspace_bytes", &jax_fa3_flash_bwd_fp8_workspace_bytes, nb::arg("batch"),
        nb::arg("heads"), nb::arg("seqlen_q"), nb::arg("head_dim"), nb::arg("deterministic"),
        "Size of the uint8 workspace result of jax_fa3_flash_bwd_fp8.");
  m.def("flash_fwd_fp8_workspace_bytes", &jax_fa3_flash_fwd_fp8_workspace_bytes,
        nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("masked"), nb::arg("v_transposed"),
        "Size of the uint8 workspace result of jax_fa3_flash_fwd_fp8.");
}
