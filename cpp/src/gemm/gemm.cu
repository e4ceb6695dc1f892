// CUDA backend of the gemm family: cuBLASLt (cublasLtMatmul) with fused epilogues.
//
// Row-major to column-major. cuBLASLt is column-major; a row-major [r, c] matrix is the
// column-major [c, r] matrix with the same bytes. So D[M, N] = op(A) @ op(B) is computed as the
// column-major D^T[N, M] = op(B)^T @ op(A)^T: cuBLASLt's "A" is our B and its "B" is our A, with
//    cuBLAS A = our B,  op = T iff transb,  stored col-major [cols_b, rows_b], ld = cols_b
//    cuBLAS B = our A,  op = T iff transa,  stored col-major [cols_a, rows_a], ld = cols_a
//    cuBLAS C, D = [N, M], ld = N;  bias / bias gradient length = cuBLAS rows of D = N;
//    aux = [N, M] with ld N (cublasLt.h: the aux leading dimension is >= D's rows, divisible by 8).
// The FP8 "TN" requirement (cuBLAS docs, cublasLtMatmul: "A must be transposed and B
// non-transposed") is therefore transb = 1, transa = 0 in our terms, checked in gemm_api.cpp.
//
// Facts used (cuBLAS documentation and the comments of cublasLt.h, CUDA 13.0):
//  - FP8 kernels need compute type CUBLAS_COMPUTE_32F and scale type CUDA_R_32F; per-tensor
//    scales come through CUBLASLT_MATMUL_DESC_{A,B,D}_SCALE_POINTER (device float, "assumed to be
//    1" when NULL) and the output amax through CUBLASLT_MATMUL_DESC_AMAX_D_POINTER ("set to the
//    maximum of absolute values in the output matrix").
//  - CUBLASLT_MATMUL_DESC_FAST_ACCUM (int8_t, default 0): fast accumulation "might be faster but
//    at the cost of lower accuracy because intermediate results will not periodically be promoted
//    to a higher precision". fus_gemm_args::use_fast_accum sets it; the default keeps it off.
//  - CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: bias elements have D's type except "fp8 kernels with an
//    output type of CUDA_R_32F, CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2" (then bf16, or bf16/fp16 = the C
//    type for an FP8 D); the bias gradient of DGELU_BGRAD has the C type. For an FP8 D the C
//    matrix type is the bias type (bf16/fp16) and C is not read (beta = 0).
//  - CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE defaults to D's type; set only for an FP8 D.
//  - Epilogues: CUBLASLT_EPILOGUE_BIAS (bias "broadcasted to all columns" of the column-major D,
//    i.e. added to every row of our D), GELU, GELU_AUX (outputs the GELU input), GELU_BIAS,
//    GELU_AUX_BIAS, DGELU (GELU gradient of the matmul output times gelu'(aux)) and DGELU_BGRAD
//    (plus the bias gradient, reduced over the rows of our D).
//  - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES default to 256: the heuristic assumes
//    256-byte aligned buffers unless told otherwise, so the real alignment of each pointer is
//    passed (tensor views from torch are often less aligned).
//
// Resources, per device: one cuBLASLt handle, created on the first GEMM on that device; per
// (device, stream): one 32 MiB workspace, allocated with cudaMalloc on the first GEMM on that
// stream (two streams never share a workspace, since cuBLASLt kernels running concurrently on
// different streams would race on it). Both live until the process exits. Per device and problem
// key, the descriptor, layouts and heuristic result are built once (LtPlan). After the first call on a stream nothing is allocated, so GEMMs
// can be captured in CUDA graphs; if the first call itself happens inside a capture, the
// allocation runs with the thread's capture mode switched to cudaStreamCaptureModeRelaxed (the
// allocation is not part of the graph and outlives it).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/activation_math.h"
#include "common/cuda_utils.h"
#include "common/fp32_ops.h"
#include "common/numerics.h"
#include "gemm/gemm_impl.h"

#if defined(FUSIBLE_WITH_CUBLASLT)
#include <cublasLt.h>
#endif

namespace fusible {

#if !defined(FUSIBLE_WITH_CUBLASLT)

void gemm_cuda(const fus_gemm_args&, const GemmShape&, const fus_context&) {
  throw Error(FUS_ERROR_UNSUPPORTED,
              "fus_gemm: this build of fusible has no cuBLASLt (CMake found neither "
              "CUDA::cublasLt nor the nvidia-cublas Python wheel), so CUDA GEMMs are unavailable; "
              "install nvidia-cublas and rebuild, or run the GEMM on the CPU");
}

#else  // FUSIBLE_WITH_CUBLASLT

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // 32 MiB per (device, stream)

void cublas_check(cublasStatus_t st, const char* what, const char* file, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw Error(FUS_ERROR_CUDA,
              std::string("fus_gemm: ") + what + " failed: " + cublasLtGetStatusName(st) + ": " +
                  cublasLtGetStatusString(st) + " (" + file + ":" + std::to_string(line) + ")");
}
#define FUS_CUBLAS_CHECK(expr) cublas_check((expr), #expr, __FILE__, __LINE__)

// ---- descriptors (RAII) -----------------------------------------------------------------------

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
    FUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, scale));
  }
  ~MatmulDesc() {
    if (d) (void)cublasLtMatmulDescDestroy(d);
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    FUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  Layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
    FUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                                static_cast<uint64_t>(cols), ld));
  }
  ~Layout() {
    if (l) (void)cublasLtMatrixLayoutDestroy(l);
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { FUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~Preference() {
    if (p) (void)cublasLtMatmulPreferenceDestroy(p);
  }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    FUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
  }
};

// ---- per-device state -----------------------------------------------------------------------

// What cuBLASLt needs for one problem, built on its first call: the descriptor (every attribute
// the key decides; the pointers are set per call), the column-major layouts of the stored
// row-major matrices (see the top of this file) and the heuristic's algorithm. A step's GEMMs then
// cost one map lookup, a few pointer attributes and the launch.
struct LtPlan {
  MatmulDesc desc;
  Layout a, b, c, d;
  cublasLtMatmulAlgo_t algo{};
  LtPlan(cublasComputeType_t compute, cudaDataType_t a_type, cudaDataType_t b_type,
         cudaDataType_t c_type, cudaDataType_t d_type, const fus_gemm_args& args,
         const GemmShape& s)
      : desc(compute, CUDA_R_32F),
        a(a_type, args.b.cols, args.b.rows, args.b.cols),  // cuBLAS A = our B
        b(b_type, args.a.cols, args.a.rows, args.a.cols),  // cuBLAS B = our A
        c(c_type, s.n, s.m, s.n),
        d(d_type, s.n, s.m, s.n) {}
};

using PlanKey = std::array<int64_t, 23>;

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  std::map<uintptr_t, void*> workspaces;              // by stream
  std::map<PlanKey, std::unique_ptr<LtPlan> > plans;  // by problem (see kMaxPlans)
};

// MoE experts' token counts change every step, and each count is a problem of its own: past this
// many plans a device's are dropped and rebuilt as they come, so the cache stays bounded.
constexpr size_t kMaxPlans = 4096;

std::mutex g_mutex;                                   // guards g_states and every DeviceState
std::vector<std::unique_ptr<DeviceState> > g_states;  // by device ordinal; never destroyed

// Switches the calling thread to relaxed stream-capture mode for the scope, so a one-time
// cudaMalloc / cublasLtCreate is legal even while a stream capture is in progress.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

// The current device's state with its handle and the workspace of stream (created on first use).
// Call with g_mutex held.
DeviceState& device_state(int device, cudaStream_t stream, void** workspace) {
  if (g_states.empty()) {
    int count = 0;
    FUS_CUDA_CHECK(cudaGetDeviceCount(&count));
    g_states.resize(static_cast<size_t>(count));
  }
  if (device < 0 || device >= static_cast<int>(g_states.size()))
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                "fus_gemm: ctx->device_index " + std::to_string(device) + " is not a CUDA device");
  auto& slot = g_states[static_cast<size_t>(device)];
  if (!slot) slot = std::make_unique<DeviceState>();
  DeviceState& st = *slot;
  const uintptr_t key = reinterpret_cast<uintptr_t>(stream);
  auto it = st.workspaces.find(key);
  if (st.handle == nullptr || it == st.workspaces.end()) {
    RelaxedCaptureScope relaxed;
    if (st.handle == nullptr) FUS_CUBLAS_CHECK(cublasLtCreate(&st.handle));
    if (it == st.workspaces.end()) {
      void* ws = nullptr;
      FUS_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
      it = st.workspaces.emplace(key, ws).first;
    }
  }
  *workspace = it->second;
  return st;
}

cudaDataType_t cuda_type(fus_dtype d) {
  switch (d) {
    case FUS_FLOAT32: return CUDA_R_32F;
    case FUS_FLOAT16: return CUDA_R_16F;
    case FUS_BFLOAT16: return CUDA_R_16BF;
    case FUS_FLOAT8_E4M3: return CUDA_R_8F_E4M3;
    case FUS_FLOAT8_E5M2: return CUDA_R_8F_E5M2;
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected dtype for cuBLASLt");
  }
}

bool is_fp8(fus_dtype d) { return d == FUS_FLOAT8_E4M3 || d == FUS_FLOAT8_E5M2; }

// Largest power of two (<= 256) dividing the address; 256 for NULL.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

// Block scale modes (gemm.h; cuBLAS docs "128-element 1D and 128x128 2D Block Scaling For FP8
// Data Types"): CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for 1x128 blocks, ..._BLK128x128_32F for
// 128x128 blocks, set through CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE (int32_t). cuBLAS A is our B.
// The layouts fusible passes are the ones the docs give: VEC128 "M-major" [ceil(K/128), R] and
// BLK128x128 "K-major" [ceil(R/128), L4] with L4 the K-block count rounded up to 4.
template <typename Desc>
void set_block_scale_modes(Desc& desc, const fus_gemm_args& args) {
#if CUBLAS_VERSION >= 120900
  auto mode = [](fus_gemm_scaling sc) {
    return static_cast<int32_t>(sc == FUS_GEMM_SCALING_BLOCK_2D
                                    ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                    : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
  };
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode(args.b_scaling));
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode(args.a_scaling));
#else
  (void)desc;
  (void)args;
  throw Error(FUS_ERROR_UNSUPPORTED,
              "fus_gemm: blockwise FP8 GEMMs need cuBLASLt 12.9 or newer (this build has " +
                  std::to_string(CUBLAS_VERSION) + ")");
#endif
}

cublasLtEpilogue_t lt_epilogue(fus_gemm_epilogue e) {
  switch (e) {
#define FUS_GEMM_LT_CASE_(id, value, name, bias, gelu, writes_aux, reads_aux, bgrad, c, f32, fp8, \
                          lt)                                                                     \
  case FUS_GEMM_EPILOGUE_##id: return CUBLASLT_EPILOGUE_##lt;
    FUS_GEMM_EPILOGUE_TABLE(FUS_GEMM_LT_CASE_)
#undef FUS_GEMM_LT_CASE_
  }
  throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected epilogue");
}

// ---- K == 0: t = beta * C (or 0), then the epilogue; cuBLASLt is not asked for empty sums
// ---------

__device__ float load_elem(fus_dtype dtype, const void* p, int64_t i) {
  switch (dtype) {
    case FUS_FLOAT16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case FUS_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// The bits of an element of `dtype` for the value v (FP8: v times fp8_scale, as on the host).
__device__ uint32_t elem_bits(fus_dtype dtype, float v, float fp8_scale) {
  switch (dtype) {
    case FUS_FLOAT16: return float_to_half(v);
    case FUS_BFLOAT16: return float_to_bf16(v);
    case FUS_FLOAT8_E4M3: return float_to_fp8<Fp8Format::kE4M3>(mul_like_host(v, fp8_scale));
    case FUS_FLOAT8_E5M2: return float_to_fp8<Fp8Format::kE5M2>(mul_like_host(v, fp8_scale));
    default: return float_as_bits(v);
  }
}

// Element i of p: elem_bits stored at the dtype's width.
__device__ void store_elem(fus_dtype dtype, void* p, int64_t i, float v, float fp8_scale) {
  const uint32_t bits = elem_bits(dtype, v, fp8_scale);
  switch (dtype) {
    case FUS_FLOAT8_E4M3:
    case FUS_FLOAT8_E5M2: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(bits); return;
    case FUS_FLOAT16:
    case FUS_BFLOAT16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits); return;
    default: static_cast<uint32_t*>(p)[i] = bits; return;
  }
}

// alpha * s as gemm_cpu computes it.
__device__ float scale_ab_of(const fus_gemm_args& args, const GemmShape& s) {
  return s.fp8 ? f_mul(args.alpha, f_mul(*args.a_scale_inv, *args.b_scale_inv)) : args.alpha;
}

// One thread per element (grid-stride); gemm_cpu's epilogue with acc = 0, operation for operation
// (fp32_ops.h: no contraction), so the results equal the CPU's bit for bit.
__global__ void empty_k_epilogue_kernel(fus_gemm_args args, GemmShape s) {
  const int64_t total = s.m * s.n;
  const float scale_ab = scale_ab_of(args, s);
  const float d_scale = args.d_scale ? *args.d_scale : 1.0f;
  uint32_t amax = 0;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t col = idx % s.n;
    float t = f_mul(scale_ab, 0.0f);
    if (s.has_c) t = f_add(t, f_mul(args.beta, load_elem(args.c.dtype, args.c.data, idx)));
    if (s.uses_bias) t = f_add(t, load_elem(args.bias.dtype, args.bias.data, col));
    float r = t;
    if (s.gelu) {
      if (s.writes_aux) store_elem(args.aux.dtype, args.aux.data, idx, t, 1.0f);
      r = gelu_tanh(t);
    } else if (s.dgelu) {
      r = f_mul(t, dgelu_tanh(load_elem(args.aux.dtype, args.aux.data, idx)));
    }
    store_elem(args.d.dtype, args.d.data, idx, r, d_scale);
    amax = max(amax, abs_bits(r));
  }
  if (args.d_amax != nullptr && amax != 0)
    atomicMax(reinterpret_cast<unsigned int*>(args.d_amax), amax);
}

// dbias[n] = sum_m D[m, n] over the fp32 values recomputed as in empty_k_epilogue_kernel (the
// stored D may be rounded); one thread per column, ascending m, as on the CPU.
__global__ void empty_k_bgrad_kernel(fus_gemm_args args, GemmShape s) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= s.n) return;
  const float t = f_mul(scale_ab_of(args, s), 0.0f);
  float sum = 0.0f;
  for (int64_t row = 0; row < s.m; ++row)
    sum =
        f_add(sum, f_mul(t, dgelu_tanh(load_elem(args.aux.dtype, args.aux.data, row * s.n + col))));
  store_elem(args.dbias.dtype, args.dbias.data, col, sum, 1.0f);
}

// No C, bias or GELU: every element of D is the same value, alpha * s * 0 (0, -0 or NaN), so D is
// a fill (16-byte stores; the wgrad GEMM of an expert that got no tokens writes all of dW this
// way, at copy bandwidth instead of one scalar epilogue per element).
__global__ void empty_k_fill_kernel(fus_gemm_args args, GemmShape s, int es, int64_t head,
                                    int64_t vecs) {
  const float r = f_mul(scale_ab_of(args, s), 0.0f);
  uint32_t bits = elem_bits(args.d.dtype, r, args.d_scale ? *args.d_scale : 1.0f);
  if (es == 1) bits *= 0x01010101u;
  if (es == 2) bits |= bits << 16;
  const uint4 pattern = make_uint4(bits, bits, bits, bits);
  uint8_t* d = static_cast<uint8_t*>(args.d.data);
  const int64_t total = s.m * s.n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  uint4* body = reinterpret_cast<uint4*>(d + head * es);
  for (int64_t i = tid; i < vecs; i += stride) body[i] = pattern;
  // The elements before the first 16-byte boundary and after the last whole vector.
  const int64_t tail = head + vecs * 16 / es;
  for (int64_t i = tid; i < head + (total - tail); i += stride) {
    const int64_t e = i < head ? i : tail + (i - head);
    switch (es) {
      case 1: d[e] = static_cast<uint8_t>(bits); break;
      case 2: reinterpret_cast<uint16_t*>(d)[e] = static_cast<uint16_t>(bits); break;
      default: reinterpret_cast<uint32_t*>(d)[e] = bits; break;
    }
  }
  if (tid == 0 && args.d_amax != nullptr && abs_bits(r) != 0)
    atomicMax(reinterpret_cast<unsigned int*>(args.d_amax), abs_bits(r));
}

void gemm_empty_k(const fus_gemm_args& args, const GemmShape& s, cudaStream_t stream) {
  constexpr int kThreads = 256;
  if (args.d_amax) FUS_CUDA_CHECK(cudaMemsetAsync(args.d_amax, 0, sizeof(float), stream));
  const int64_t total = s.m * s.n;
  if (!s.has_c && !s.uses_bias && !s.gelu && !s.dgelu && !s.bgrad) {
    const int64_t es = static_cast<int64_t>(fus_dtype_size(args.d.dtype));
    const uintptr_t addr = reinterpret_cast<uintptr_t>(args.d.data);
    int64_t head = static_cast<int64_t>((16 - addr % 16) % 16) / es;
    if (head > total) head = total;
    const int64_t vecs = (total - head) * es / 16;
    const int64_t want = (vecs + kThreads - 1) / kThreads + 1;
    const int blocks = static_cast<int>(std::min<int64_t>(want, int64_t{8} * sm_count()));
    // clang-format off
    empty_k_fill_kernel<<<blocks, kThreads, 0, stream>>>(args, s, static_cast<int>(es), head, vecs);
    // clang-format on
    FUS_CUDA_CHECK_LAUNCH("empty_k_fill_kernel");
    return;
  }
  const int64_t want = (total + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(want, int64_t{8} * sm_count()));
  // clang-format off
  empty_k_epilogue_kernel<<<blocks, kThreads, 0, stream>>>(args, s);
  // clang-format on
  FUS_CUDA_CHECK_LAUNCH("empty_k_epilogue_kernel");
  if (s.bgrad) {
    const int cols_blocks = static_cast<int>((s.n + kThreads - 1) / kThreads);
    // clang-format off
    empty_k_bgrad_kernel<<<cols_blocks, kThreads, 0, stream>>>(args, s);
    // clang-format on
    FUS_CUDA_CHECK_LAUNCH("empty_k_bgrad_kernel");
  }
}

}  // namespace

void gemm_cuda(const fus_gemm_args& args, const GemmShape& s, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  const bool d_fp8 = is_fp8(args.d.dtype);

  if (s.m == 0 || s.n == 0) {  // nothing to multiply: zero sums
    if (s.bgrad && s.n > 0)
      FUS_CUDA_CHECK(cudaMemsetAsync(
          args.dbias.data, 0, static_cast<size_t>(s.n) * fus_dtype_size(args.dbias.dtype), stream));
    if (args.d_amax) FUS_CUDA_CHECK(cudaMemsetAsync(args.d_amax, 0, sizeof(float), stream));
    return;
  }
  if (s.k == 0) {
    gemm_empty_k(args, s, stream);
    return;
  }

  // Types. For an FP8 D the C type is the epilogue type (bias / aux / dbias dtype, bf16 if none).
  const cudaDataType_t a_type = cuda_type(args.b.dtype);  // cuBLAS A = our B
  const cudaDataType_t b_type = cuda_type(args.a.dtype);  // cuBLAS B = our A
  const cudaDataType_t d_type = cuda_type(args.d.dtype);
  cudaDataType_t c_type = d_type;
  if (d_fp8) {
    c_type = CUDA_R_16BF;
    if (s.uses_bias)
      c_type = cuda_type(args.bias.dtype);
    else if (s.writes_aux || s.dgelu)
      c_type = cuda_type(args.aux.dtype);
    else if (s.bgrad)
      c_type = cuda_type(args.dbias.dtype);
  }
  const bool fp32_operands = !s.fp8 && args.a.dtype == FUS_FLOAT32;
  const cublasComputeType_t compute =
      (fp32_operands && args.use_fast_accum) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  const cublasOperation_t op_a = args.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = args.transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = lt_epilogue(args.epilogue);
  const void* vec_ptr = nullptr;  // bias (input) or bias gradient (output)
  fus_dtype vec_dtype = args.d.dtype;
  if (s.uses_bias) {
    vec_ptr = args.bias.data;
    vec_dtype = args.bias.dtype;
  } else if (s.bgrad) {
    vec_ptr = args.dbias.data;
    vec_dtype = args.dbias.dtype;
  }
  const bool aux = s.writes_aux || s.dgelu;

  // C: read only when beta != 0 (HP D). Otherwise D is passed as C (never read with beta = 0);
  // an FP8 D has no C at all.
  const void* c_ptr = s.has_c ? args.c.data : (d_fp8 ? nullptr : args.d.data);
  const float alpha = args.alpha;
  const float beta = s.has_c ? args.beta : 0.0f;

  const uint32_t align_a = alignment_of(args.b.data), align_b = alignment_of(args.a.data);
  const uint32_t align_c = alignment_of(c_ptr), align_d = alignment_of(args.d.data);

  // Everything the descriptor's attributes and the heuristic see: shapes, types, ops, epilogue,
  // which optional pointers are set and the alignments of every pointer the heuristic inspects.
  const PlanKey key = {s.m,
                       s.n,
                       s.k,
                       static_cast<int64_t>(args.a.dtype),
                       static_cast<int64_t>(args.b.dtype),
                       static_cast<int64_t>(args.d.dtype),
                       static_cast<int64_t>(c_type),
                       args.transa,
                       args.transb,
                       static_cast<int64_t>(epilogue),
                       static_cast<int64_t>(vec_dtype),
                       static_cast<int64_t>(args.aux.dtype),
                       args.use_fast_accum,
                       s.has_c ? 1 : 0,
                       args.d_amax ? 1 : 0,
                       align_a,
                       align_b,
                       align_c,
                       align_d,
                       alignment_of(vec_ptr),
                       alignment_of(args.aux.data),
                       static_cast<int64_t>(s.blockwise ? args.a_scaling : 0),
                       static_cast<int64_t>(s.blockwise ? args.b_scaling : 0)};

  // The pointer attributes: the only ones that change between calls of one plan (whether each is
  // set is in the key).
  auto set_pointers = [&](MatmulDesc& desc) {
    if (s.fp8) {
      desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.b_scale_inv);
      desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.a_scale_inv);
    }
    if (d_fp8) {
      desc.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, args.d_scale);
      if (args.d_amax) desc.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, args.d_amax);
    }
    if (vec_ptr != nullptr) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, vec_ptr);
    if (aux)
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(args.aux.data));
  };

  // Built once per key: the descriptor with every attribute the key decides, the column-major
  // layouts of the stored row-major matrices (see the top of this file) and the heuristic's
  // algorithm.
  auto make_plan = [&](cublasLtHandle_t handle) {
    auto p = std::make_unique<LtPlan>(compute, a_type, b_type, c_type, d_type, args, s);
    MatmulDesc& desc = p->desc;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    if (s.fp8) {
      // Block scaling has no fast accumulation (torch's scaled_gemm refuses it there too).
      const int8_t fast = (args.use_fast_accum && !s.blockwise) ? 1 : 0;
      desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    }
    if (s.blockwise) set_block_scale_modes(desc, args);
    if (vec_ptr != nullptr && (s.fp8 || vec_dtype != args.d.dtype)) {
      const int32_t t = static_cast<int32_t>(cuda_type(vec_dtype));
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, t);
    }
    if (aux) {
      const int64_t ld_aux = s.n;
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld_aux);
      if (args.aux.dtype != args.d.dtype) {
        const int32_t t = static_cast<int32_t>(cuda_type(args.aux.dtype));
        desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, t);
      }
    }
    set_pointers(desc);  // the heuristic sees the descriptor as the first call has it
    Preference pref;
    const uint64_t ws_bytes = kWorkspaceBytes;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws_bytes);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int count = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, p->a.l, p->b.l, p->c.l,
                                                             p->d.l, pref.p, 1, &result, &count);
    if (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && count == 0)) {
      throw Error(FUS_ERROR_UNSUPPORTED,
                  std::string("fus_gemm: cuBLASLt has no algorithm for this GEMM on this device "
                              "(M=") +
                      std::to_string(s.m) + ", N=" + std::to_string(s.n) +
                      ", K=" + std::to_string(s.k) + ", a " + dtype_name(args.a.dtype) + ", b " +
                      dtype_name(args.b.dtype) + ", d " + dtype_name(args.d.dtype) + ", epilogue " +
                      std::to_string(static_cast<int>(args.epilogue)) +
                      (s.blockwise ? "); blockwise FP8 GEMMs need compute capability 9.0"
                                   : "); FP8 GEMMs need compute capability 8.9 or newer"));
    }
    FUS_CUBLAS_CHECK(hs);
    p->algo = result.algo;
    return p;
  };

  void* workspace = nullptr;
  // Held through the launch: a plan's descriptor is shared, and its pointers are this call's.
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceState& st = device_state(current_device(), stream, &workspace);
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    if (st.plans.size() >= kMaxPlans) st.plans.clear();
    it = st.plans.emplace(key, make_plan(st.handle)).first;
  } else {
    set_pointers(it->second->desc);
  }
  LtPlan& p = *it->second;
  FUS_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.desc.d, &alpha, args.b.data, p.a.l, args.a.data,
                                  p.b.l, &beta, c_ptr, p.c.l, args.d.data, p.d.l, &p.algo,
                                  workspace, kWorkspaceBytes, stream));
#if !defined(NDEBUG)
  FUS_CUDA_CHECK(cudaGetLastError());
#endif
}

#endif  // FUSIBLE_WITH_CUBLASLT

}  // namespace fusible
