// Element access to high-precision matrices whose dtype is known only at run time (fp32, fp16,
// bf16), for kernels that would otherwise need one instantiation per combination of input,
// weight and output dtypes. Branches on the dtype are uniform across a kernel's threads.
#pragma once

#include "common/fp32_ops.h"
#include "fusible/common.h"

namespace fusible {

FUS_HD float load_hp(const void* p, fus_dtype dt, int64_t i) {
  if (dt == FUS_FLOAT32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == FUS_BFLOAT16 ? bf16_to_float(h) : half_to_float(h);
}

// Stores v rounded (RNE) to dt.
FUS_HD void store_hp(void* p, fus_dtype dt, int64_t i, float v) {
  if (dt == FUS_FLOAT32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = dt == FUS_BFLOAT16 ? float_to_bf16(v) : float_to_half(v);
  }
}

// v rounded to dt, as a float (exact widening): the value a store then a load would give.
FUS_HD float round_hp(fus_dtype dt, float v) {
  if (dt == FUS_FLOAT32) return v;
  return dt == FUS_BFLOAT16 ? round_to<Bf16>(v) : round_to<Half>(v);
}

}  // namespace fusible
