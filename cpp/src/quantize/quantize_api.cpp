// C API of the quantize family: validation, then dispatch to the CPU or CUDA backend.
#include <cmath>
#include <string>

#include "common/validate.h"
#include "fusible/quantize.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr std::initializer_list<fus_dtype> kFp8 = {FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2};

bool is_blockwise(fus_scaling_mode mode) {
  return mode == FUS_SCALING_BLOCK_1D || mode == FUS_SCALING_BLOCK_2D;
}

// The cast of a validated (input, out) on ctx's backend, every mode.
void cast(const fus_tensor& input, const fus_quantized& out, const fus_context& ctx) {
  if (is_cuda(&ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
    if (is_blockwise(out.mode))
      quantize_blockwise_cuda(input, out, ctx);
    else
      quantize_cuda(input, out, ctx);
#endif
  } else {
    cast_cpu(input, out);
  }
}

// The per-tensor scale rule on one amax, on ctx's backend.
void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin,
                     const fus_context& ctx) {
  if (is_cuda(&ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
    scale_from_amax_cuda(amax, scale, scale_inv, fp8_max, margin, false, ctx);
#endif
  } else {
    scale_from_amax_cpu(amax, scale, scale_inv, fp8_max, margin, false);
  }
}

}  // namespace
}  // namespace fusible

using namespace fusible;

extern "C" {

fus_status fus_quantize(const fus_tensor* input, fus_quantized* out, const fus_context* ctx) {
  constexpr const char* fn = "fus_quantize";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_matrix(fn, "input", input, kHighPrecision);
    check_quantized(fn, "out", out, input->rows, input->cols);
    if (input->rows * input->cols > 0 && out->mode == FUS_SCALING_PER_TENSOR)
      require(out->scale != nullptr, fn, "out->scale is NULL; per-tensor scaling needs float[1]");
    cast(*input, *out, *ctx);
    return FUS_SUCCESS;
  });
}

fus_status fus_quantize_blockwise(const fus_tensor* input, fus_quantized* out, int power_2_scale,
                                  float amax_epsilon, const fus_context* ctx) {
  constexpr const char* fn = "fus_quantize_blockwise";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_matrix(fn, "input", input, kHighPrecision);
    require(out != nullptr, fn, "out is NULL");
    require(is_blockwise(out->mode), fn,
            "out->mode must be FUS_SCALING_BLOCK_1D or FUS_SCALING_BLOCK_2D");
    fus_quantized q = *out;
    q.power_2_scale = power_2_scale;
    q.amax_epsilon = amax_epsilon;
    check_quantized(fn, "out", &q, input->rows, input->cols);
    cast(*input, q, *ctx);
    return FUS_SUCCESS;
  });
}

fus_status fus_compute_amax(const fus_tensor* input, float* amax, const fus_context* ctx) {
  constexpr const char* fn = "fus_compute_amax";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_matrix(fn, "input", input, kHighPrecision);
    require(amax != nullptr, fn, "amax is NULL; expected float[1]");
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      amax_cuda(*input, amax, *ctx);
#endif
    } else {
      amax_cpu(*input, amax);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_quantize_current_scaling(const fus_tensor* input, fus_quantized* out, int margin,
                                        const fus_context* ctx) {
  constexpr const char* fn = "fus_quantize_current_scaling";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_matrix(fn, "input", input, kHighPrecision);
    check_quantized(fn, "out", out, input->rows, input->cols);
    require(out->mode == FUS_SCALING_PER_TENSOR, fn,
            "out->mode must be FUS_SCALING_PER_TENSOR (current scaling is per tensor)");
    require(out->amax != nullptr && out->scale != nullptr, fn,
            "out->amax and out->scale must both be float[1]");
    require(out->amax_accumulate == 0, fn,
            "out->amax_accumulate must be 0 (current scaling scales by the tensor's own amax)");
    require(out->rowwise_scale_inv != nullptr, fn, "out->rowwise_scale_inv is NULL");
    // Pass 1: amax. Then the scale (one scalar). Pass 2: the cast, which need not re-reduce amax.
    fus_status st = fus_compute_amax(input, out->amax, ctx);
    if (st != FUS_SUCCESS) return st;
    fus_quantized q = *out;
    q.amax = nullptr;
#if defined(FUSIBLE_WITH_CUDA)
    if (is_cuda(ctx) && input->rows * input->cols > 0) {
      // On CUDA the cast applies the scale rule itself: one launch fewer (the host's cost).
      const CurrentScale c{out->amax, out->scale, fus_fp8_max(out->dtype), margin};
      quantize_cuda(*input, q, *ctx, &c);
      return FUS_SUCCESS;
    }
#endif
    scale_from_amax(out->amax, out->scale, nullptr, fus_fp8_max(out->dtype), margin, *ctx);
    cast(*input, q, *ctx);
    return FUS_SUCCESS;
  });
}

fus_status fus_quantize_grouped(const fus_tensor* inputs, fus_quantized* outs, int64_t count,
                                int current_scaling, int margin, const fus_context* ctx) {
  constexpr const char* fn = "fus_quantize_grouped";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    require(count >= 0, fn, "count must be >= 0, got " + std::to_string(count));
    if (count == 0) return FUS_SUCCESS;
    require(inputs != nullptr && outs != nullptr, fn, "inputs and outs must not be NULL");
    require(margin >= 0, fn, "margin must be >= 0, got " + std::to_string(margin));
    for (int64_t g = 0; g < count; ++g) {
      const std::string in_name = "inputs[" + std::to_string(g) + "]";
      const std::string out_name = "outs[" + std::to_string(g) + "]";
      const fus_tensor* in = inputs + g;
      fus_quantized* out = outs + g;
      check_matrix(fn, in_name.c_str(), in, kHighPrecision);
      check_quantized(fn, out_name.c_str(), out, in->rows, in->cols);
      require(out->mode == FUS_SCALING_PER_TENSOR, fn,
              out_name + ".mode must be FUS_SCALING_PER_TENSOR (grouped casts are per tensor)");
      require(in->dtype == inputs[0].dtype, fn,
              in_name + " has dtype " + dtype_name(in->dtype) + ", expected inputs[0]'s " +
                  dtype_name(inputs[0].dtype) + " (one input dtype per group)");
      require(out->dtype == outs[0].dtype, fn,
              out_name + ".dtype is " + dtype_name(out->dtype) + ", expected outs[0]'s " +
                  dtype_name(outs[0].dtype) + " (one FP8 dtype per group)");
      require(out->rowwise_scale_inv != nullptr, fn, out_name + ".rowwise_scale_inv is NULL");
      if (current_scaling) {
        require(out->amax != nullptr && out->scale != nullptr, fn,
                out_name + ".amax and " + out_name + ".scale must both be float[1]");
        require(out->amax_accumulate == 0, fn,
                out_name +
                    ".amax_accumulate must be 0 (current scaling scales by the tensor's own amax)");
      } else {
        require(out->scale != nullptr, fn,
                out_name + ".scale is NULL; delayed scaling casts with a given float[1] scale");
      }
    }
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      quantize_grouped_cuda(inputs, outs, count, current_scaling != 0, margin, *ctx);
#endif
    } else {
      // The per-tensor calls themselves, one after another: the same bits by construction.
      const float fp8_max = fus_fp8_max(outs[0].dtype);
      for (int64_t g = 0; g < count; ++g) {
        if (current_scaling) {
          amax_cpu(inputs[g], outs[g].amax);
          scale_from_amax_cpu(outs[g].amax, outs[g].scale, nullptr, fp8_max, margin, false);
          fus_quantized q = outs[g];
          q.amax = nullptr;
          cast_cpu(inputs[g], q);
        } else {
          cast_cpu(inputs[g], outs[g]);
        }
      }
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_dequantize(const fus_quantized* in, int columnwise, fus_tensor* output,
                          const fus_context* ctx) {
  constexpr const char* fn = "fus_dequantize";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    require(in != nullptr, fn, "in is NULL");
    check_quantized(fn, "in", in, in->rows, in->cols);
    check_matrix(fn, "output", output, kHighPrecision);
    const bool transposed = columnwise && in->mode != FUS_SCALING_MXFP8;
    check_same_shape(fn, "output", output, transposed ? in->cols : in->rows,
                     transposed ? in->rows : in->cols);
    if (in->rows * in->cols > 0) {
      require((columnwise ? in->columnwise_data : in->rowwise_data) != nullptr, fn,
              columnwise ? "in->columnwise_data is NULL" : "in->rowwise_data is NULL");
    }
    const bool blockwise = in->mode == FUS_SCALING_BLOCK_1D || in->mode == FUS_SCALING_BLOCK_2D;
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      if (blockwise)
        dequantize_blockwise_cuda(*in, columnwise != 0, *output, *ctx);
      else
        dequantize_cuda(*in, columnwise != 0, *output, *ctx);
#endif
    } else if (blockwise) {
      dequantize_blockwise_cpu(*in, columnwise != 0, *output);
    } else {
      dequantize_cpu(*in, columnwise != 0, *output);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_transpose_fp8(const fus_tensor* input, fus_tensor* output, const fus_context* ctx) {
  constexpr const char* fn = "fus_transpose_fp8";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_matrix(fn, "input", input, kFp8);
    check_matrix(fn, "output", output, kFp8);
    require(output->dtype == input->dtype, fn,
            std::string("output has dtype ") + dtype_name(output->dtype) +
                ", expected the input's dtype " + dtype_name(input->dtype));
    check_same_shape(fn, "output", output, input->cols, input->rows);
    if (input->rows * input->cols > 0) {
      const auto n = static_cast<uintptr_t>(input->rows * input->cols);
      const auto in = reinterpret_cast<uintptr_t>(input->data);
      const auto out = reinterpret_cast<uintptr_t>(output->data);
      require(out + n <= in || in + n <= out, fn,
              "output overlaps input; expected separate buffers (no in-place transpose)");
    }
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      transpose_fp8_cuda(*input, *output, *ctx);
#endif
    } else {
      transpose_fp8_cpu(*input, *output);
    }
    return FUS_SUCCESS;
  });
}

}  // extern "C"
