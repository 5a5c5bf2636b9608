// The only pybind11 translation unit. `_C` exists so that `import
// megatron_fsdp_v2._C` loads this shared object, which runs the static
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations of the other files. It
// exposes build facts only; tensor ops go through the dispatcher
// (torch.ops.megatron_fsdp_v2.*), never through pybind11.
#include <torch/extension.h>

#ifdef MFSDP_WITH_CUDA
#include <cuda_runtime_api.h>  // CUDART_VERSION of the toolkit we compiled with
#endif

// setup.py passes -DMFSDP_TORCH_VERSION=<torch.__version__> unquoted.
#define MFSDP_STRINGIFY_(x) #x
#define MFSDP_STRINGIFY(x) MFSDP_STRINGIFY_(x)

namespace mfsdp {
namespace {

std::string torch_version_built() {
#ifdef MFSDP_TORCH_VERSION
  return MFSDP_STRINGIFY(MFSDP_TORCH_VERSION);
#else
  return "unknown";
#endif
}

pybind11::object cuda_version_built() {
#ifdef MFSDP_WITH_CUDA
  const int v = CUDART_VERSION;  // e.g. 13000 -> "13.0"
  return pybind11::str(std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10));
#else
  return pybind11::none();
#endif
}

bool cuda_kernels_compiled() {
#ifdef MFSDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace mfsdp

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatron_fsdp_v2 native extension; ops live in torch.ops.megatron_fsdp_v2.*";
  m.def("torch_version_built", &mfsdp::torch_version_built,
        "torch.__version__ this extension was compiled against");
  m.def("cuda_version_built", &mfsdp::cuda_version_built,
        "CUDA toolkit version compiled against, or None for a CPU-only build");
  m.def("cpu_kernels_compiled", [] { return true; }, "CPU kernels are always compiled");
  m.def("cuda_kernels_compiled", &mfsdp::cuda_kernels_compiled,
        "whether CUDA kernels were compiled");
}
