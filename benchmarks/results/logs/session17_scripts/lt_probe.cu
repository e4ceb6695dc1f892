// Probe: time every heuristic algorithm of cuBLASLt's block-scaled FP8 GEMM at a shape.
// usage: lt_probe M N K amode bmode [n_algos]   (mode 1 = VEC128 (1x128), 2 = BLK128x128)
// Row-major D[M,N] = A[M,K] B[N,K]^T, computed as column-major D^T = B^T... (cuBLAS A = our B).
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { auto s_ = (x); if (s_ != 0) { printf("err %d at %s:%d\n", (int)s_, __FILE__, __LINE__); exit(1);} } while (0)
int main(int argc, char** argv) {
  long M = atol(argv[1]), N = atol(argv[2]), K = atol(argv[3]);
  int am = atoi(argv[4]), bm = atoi(argv[5]);
  int nreq = argc > 6 ? atoi(argv[6]) : 32;
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  void *A, *B, *D, *sa, *sb, *ws; size_t wsb = 32 << 20;
  CK(cudaMalloc(&A, M * K)); CK(cudaMalloc(&B, N * K)); CK(cudaMalloc(&D, M * N * 2));
  CK(cudaMalloc(&sa, 64 << 20)); CK(cudaMalloc(&sb, 64 << 20)); CK(cudaMalloc(&ws, wsb));
  // random-ish fp8 bytes (avoid NaN 0x7f/0xff): small values
  std::vector<unsigned char> hA(M * K), hB(N * K);
  unsigned s = 1; for (auto& v : hA) { s = s * 1664525u + 1013904223u; v = (s >> 24) & 0x77; }
  for (auto& v : hB) { s = s * 1664525u + 1013904223u; v = (s >> 24) & 0x77; }
  CK(cudaMemcpy(A, hA.data(), M * K, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(B, hB.data(), N * K, cudaMemcpyHostToDevice));
  std::vector<float> ones(16 << 20, 1.0f);
  CK(cudaMemcpy(sa, ones.data(), 64 << 20, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sb, ones.data(), 64 << 20, cudaMemcpyHostToDevice));
  cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t T = CUBLAS_OP_T, Nn = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &Nn, sizeof(Nn)));
  auto mode = [](int m) { return (int32_t)(m == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F); };
  int32_t ma = mode(bm), mb = mode(am);  // cuBLAS A = our B
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof(sb)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof(sa)));
  cublasLtMatrixLayout_t la, lb, lc;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));  // our B [N,K] row-major = col-major [K,N]
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K));
  CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
  cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(nreq); int cnt = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, nreq, res.data(), &cnt));
  float alpha = 1, beta = 0;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  double flops = 2.0 * M * N * K;
  printf("M=%ld N=%ld K=%ld a=%s b=%s: %d algos\n", M, N, K, am == 1 ? "1x128" : "128x128", bm == 1 ? "1x128" : "128x128", cnt);
  for (int i = 0; i < cnt; ++i) {
    int tile = 0, stages = 0, splitk = 0, swz = 0, cluster = 0, algoid = 0; size_t w;
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &algoid, sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(int), &w);
    auto run = [&]() { return cublasLtMatmul(h, desc, &alpha, B, la, A, lb, &beta, D, lc, D, lc, &res[i].algo, ws, wsb, 0); };
    if (run() != CUBLAS_STATUS_SUCCESS) { printf("  algo %2d: launch failed\n", i); continue; }
    for (int r = 0; r < 3; ++r) run();
    cudaEventRecord(e0);
    const int reps = 20;
    for (int r = 0; r < reps; ++r) run();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= reps;
    printf("  algo %2d: id %d tile %d stages %d splitk %d swizzle %d cluster %d ws %zu: %.3f ms %.0f TFLOP/s\n",
           i, algoid, tile, stages, splitk, swz, cluster, res[i].workspaceSize, ms, flops / ms / 1e9);
  }
  CK(cudaGetLastError());
  return 0;
}
