/*
 * fusible core library: the recipe family (delayed-scaling state update).
 *
 * Delayed scaling keeps, per RecipeState, an amax history H [history_len, n] (one column per
 * quantizer) and scales S [n]. During a step, each cast writes its tensor's amax into H[0, i].
 * fus_delayed_scaling_update then, for every group and every column i, in one launch:
 *   1. amax_i = max_k H[k, i]   (algo FUS_AMAX_MAX)   or   H[0, i]   (algo FUS_AMAX_MOST_RECENT);
 *      NaN in the reduced rows makes amax_i NaN.
 *   2. S[i]   = ldexp(fp8_max / amax_i, -margin) if amax_i is finite and > 0 (FLT_MAX on overflow),
 *               else S[i] unchanged, so amax 0 / inf / NaN never produces an inf/NaN scale.
 *   3. roll:    H[k, i] = H[k + 1, i] for k < history_len - 1, then H[history_len - 1, i] = the
 *               old H[0, i], then H[0, i] = 0 (so row 0 is fresh for the next step's amaxes and the
 *               newest amax moves to the end of the window). With history_len == 1 only the reset
 *               happens.
 */
#ifndef FUSIBLE_RECIPE_H_
#define FUSIBLE_RECIPE_H_

#include "fusible/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The amax algorithm table: one row an algorithm, X(ID, value, name). Every list of them is read
 * from it: the enum below, the C API's check (recipe_api.cpp), the torch operator's algo names
 * (cpp/bindings/ops_recipe.cpp) and Python's AMAX_ALGOS (through fus_amax_algo_name), which
 * DelayedScaling's amax_compute_algo accepts.
 */
#define FUS_AMAX_ALGO_TABLE(X) \
  X(MAX, 0, "max")             \
  X(MOST_RECENT, 1, "most_recent")

typedef enum fus_amax_algo {
#define FUS_AMAX_ENUMERATOR_(id, value, name) FUS_AMAX_##id = value,
  FUS_AMAX_ALGO_TABLE(FUS_AMAX_ENUMERATOR_)
#undef FUS_AMAX_ENUMERATOR_
} fus_amax_algo;

/* The algorithm's name ("max", "most_recent": the torch operator's and Python's spelling); NULL
 * for a value that is not an algorithm (so they are 0, 1, ... up to the first NULL). */
const char* fus_amax_algo_name(fus_amax_algo algo);

typedef struct fus_delayed_scaling_group {
  float* amax_history; /* [history_len, n], row-major */
  float* scale;        /* [n] */
  int64_t history_len; /* >= 1 */
  int64_t n;           /* >= 0 */
  float fp8_max;       /* 448 (E4M3) or 57344 (E5M2) */
} fus_delayed_scaling_group;

/* Update all groups (host array of descriptors; their pointers are on ctx's device). */
fus_status fus_delayed_scaling_update(const fus_delayed_scaling_group* groups, int num_groups,
                                      fus_amax_algo algo, int margin, const fus_context* ctx);

/*
 * Per-tensor scale from an amax (see quantize.h): scale[0] = f(amax[0], fp8_max, margin, fallback
 * = scale[0] if keep_previous else 1), scale_inv[0] = 1 / scale[0] (scale_inv may be NULL).
 */
fus_status fus_compute_scale(const float* amax, float* scale, float* scale_inv, float fp8_max,
                             int margin, int keep_previous, const fus_context* ctx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_RECIPE_H_ */
