// User-facing argument checks of the front end (csrc/ops.cpp), run once per call
// for every backend.
//
// Every message starts with the op name and names the offending argument, so a
// failure inside a flat group of hundreds of parameters points at one of them.
// These are TORCH_CHECKs (RuntimeError in Python). What the dispatcher already
// guarantees (e.g. "this CPU kernel got a CPU flat buffer") is asserted with
// TORCH_INTERNAL_ASSERT at the call site instead. The Python validators in
// megatron_fsdp_v2/ops/_checks.py repeat these messages word for word.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <ostream>

namespace mfsdp {

// The name of an argument as the user sees it: "flat", or an element of a list,
// "inputs[3]". These checks run on every op call for every tensor of a list, so the
// name is two words and is formatted only when a check fails (TORCH_CHECK builds its
// message only then, streaming this through operator<<): nothing is allocated on
// the success path.
struct ArgName {
  const char* name;
  int64_t index;  // -1: the argument itself, not an element of a list
  ArgName(const char* arg) : name(arg), index(-1) {}  // NOLINT(google-explicit-constructor)
  ArgName(const char* list_arg, int64_t i) : name(list_arg), index(i) {}
};

inline std::ostream& operator<<(std::ostream& out, const ArgName& arg) {
  out << arg.name;
  if (arg.index >= 0) {
    out << "[" << arg.index << "]";
  }
  return out;
}

// The Python package's list is SUPPORTED_DTYPES in megatron_fsdp_v2/api.py; the
// kernels' AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16) covers exactly these.
inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// `arg` is the argument name as the user sees it, e.g. "flat" or "inputs[3]".
inline void check_supported_dtype(const at::Tensor& t, const char* op, const ArgName& arg) {
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": unsupported dtype ", t.scalar_type(),
              " for `", arg, "`; expected float32, float16, bfloat16 or float64");
}

inline void check_contiguous(const at::Tensor& t, const char* op, const ArgName& arg) {
  TORCH_CHECK(t.is_contiguous(), op, ": `", arg, "` must be contiguous, got shape ", t.sizes(),
              " with strides ", t.strides());
}

// A flat buffer: 1-D, contiguous, supported dtype.
inline void check_flat_buffer(const at::Tensor& t, const char* op, const ArgName& arg) {
  TORCH_CHECK(t.dim() == 1, op, ": `", arg, "` must be a 1-D flat buffer, got a ", t.dim(),
              "-D tensor of shape ", t.sizes());
  check_contiguous(t, op, arg);
  check_supported_dtype(t, op, arg);
}

inline void check_same_device(const at::Tensor& t, const ArgName& arg, const at::Tensor& ref,
                              const ArgName& ref_arg, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": device mismatch: `", arg, "` is on ", t.device(),
              " but `", ref_arg, "` is on ", ref.device());
}

// A list of tensors copied into a flat buffer (pack_): one offset per
// tensor, every tensor contiguous, one dtype and one device for the whole list, and
// each [offset, offset + numel) inside the flat buffer.
inline void check_list_and_flat(at::TensorList tensors, const char* list_arg,
                                at::IntArrayRef offsets, const at::Tensor& flat,
                                const char* flat_arg, const char* op) {
  check_flat_buffer(flat, op, flat_arg);
  TORCH_CHECK(tensors.size() == offsets.size(), op, ": list length mismatch: got ",
              tensors.size(), " tensors in `", list_arg, "` but ", offsets.size(),
              " `offsets`; expected one offset per tensor");
  const int64_t flat_numel = flat.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const ArgName arg(list_arg, static_cast<int64_t>(i));
    check_same_device(t, arg, flat, flat_arg, op);
    if (i == 0) {
      check_supported_dtype(t, op, arg);
    } else {
      TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op, ": dtype mismatch in `",
                  list_arg, "`: ", list_arg, "[0] is ", tensors[0].scalar_type(), " but ", arg,
                  " is ", t.scalar_type(), "; all tensors in one call must share a dtype");
    }
    check_contiguous(t, op, arg);
    const int64_t offset = offsets[i];
    const int64_t numel = t.numel();
    TORCH_CHECK(offset >= 0 && offset <= flat_numel && numel <= flat_numel - offset, op,
                ": offsets[", i, "] out of range: ", arg, " at offset ", offset, " with numel ",
                numel, " needs elements [", offset, ", ", offset + numel, ") but `", flat_arg,
                "` has numel ", flat_numel);
  }
}

// A non-empty list of contiguous tensors of one supported dtype on one device.
inline void check_tensor_list(at::TensorList tensors, const char* list_arg, const char* op) {
  TORCH_CHECK(!tensors.empty(), op, ": `", list_arg,
              "` is empty; the Python wrapper handles empty lists (pass device=)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const ArgName arg(list_arg, static_cast<int64_t>(i));
    if (i == 0) {
      check_supported_dtype(t, op, arg);
    } else {
      const ArgName first(list_arg, 0);
      check_same_device(t, arg, tensors[0], first, op);
      TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op, ": dtype mismatch in `",
                  list_arg, "`: ", first, " is ", tensors[0].scalar_type(), " but ", arg, " is ",
                  t.scalar_type(), "; all tensors in one call must share a dtype");
    }
    check_contiguous(t, op, arg);
  }
}

// ---------------------------------------------------------------------------
// fp8_quantize_ (csrc/ops.cpp): the checks of pack_'s list and flat buffer, with
// the dtypes of the quantize op, plus one scale and one amax slot per input.

inline bool is_fp8_dtype(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// The inputs a main-weight shard can have; float64 is not accepted because
// `x.float()` would round it before the multiply.
inline bool is_quantize_input_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A one-element float32 tensor (0-dim or shape (1,)) on `flat`'s device: a
// per-tensor scale or amax slot, read or written by the kernel without a host sync.
inline void check_fp32_slot(const at::Tensor& t, const ArgName& arg, const at::Tensor& flat,
                            const char* flat_arg, const char* op) {
  check_same_device(t, arg, flat, flat_arg, op);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": `", arg,
              "` must be a float32 tensor with one element (0-dim or shape (1,)), got ",
              t.scalar_type(), " of shape ", t.sizes());
}

inline void check_fp8_quantize(at::TensorList inputs, at::TensorList scales,
                               at::IntArrayRef offsets, const at::Tensor& flat,
                               at::TensorList amaxes, const char* op) {
  TORCH_CHECK(flat.dim() == 1, op, ": `flat` must be a 1-D flat buffer, got a ", flat.dim(),
              "-D tensor of shape ", flat.sizes());
  check_contiguous(flat, op, "flat");
  TORCH_CHECK(is_fp8_dtype(flat.scalar_type()), op, ": unsupported dtype ", flat.scalar_type(),
              " for `flat`; expected float8_e4m3fn or float8_e5m2");
  const size_t n = inputs.size();
  TORCH_CHECK(scales.size() == n && offsets.size() == n && amaxes.size() == n, op,
              ": list length mismatch: got ", n, " tensors in `inputs`, ", scales.size(),
              " `scales`, ", offsets.size(), " `offsets` and ", amaxes.size(),
              " `amaxes`; expected one of each per input");
  const int64_t flat_numel = flat.numel();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = inputs[i];
    const ArgName arg("inputs", static_cast<int64_t>(i));
    check_same_device(t, arg, flat, "flat", op);
    if (i == 0) {
      TORCH_CHECK(is_quantize_input_dtype(t.scalar_type()), op, ": unsupported dtype ",
                  t.scalar_type(), " for `", arg, "`; expected float32, float16 or bfloat16");
    } else {
      TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), op,
                  ": dtype mismatch in `inputs`: inputs[0] is ", inputs[0].scalar_type(),
                  " but ", arg, " is ", t.scalar_type(),
                  "; all tensors in one call must share a dtype");
    }
    check_contiguous(t, op, arg);
    const int64_t offset = offsets[i];
    const int64_t numel = t.numel();
    TORCH_CHECK(offset >= 0 && offset <= flat_numel && numel <= flat_numel - offset, op,
                ": offsets[", i, "] out of range: ", arg, " at offset ", offset, " with numel ",
                numel, " needs elements [", offset, ", ", offset + numel,
                ") but `flat` has numel ", flat_numel);
    check_fp32_slot(scales[i], ArgName("scales", static_cast<int64_t>(i)), flat, "flat", op);
    check_fp32_slot(amaxes[i], ArgName("amaxes", static_cast<int64_t>(i)), flat, "flat", op);
  }
}

}  // namespace mfsdp
