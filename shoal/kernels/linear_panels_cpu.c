/* A dense linear layer on CPU over weights prepacked into panels (linear_panels_cpu.py packs
   them once at load): y[r] = x[r] . W^T + bias, W [out, in] float32 or bfloat16.

   Layout: panels [P, in, PW], P = ceil(out / PW); panel p holds output features
   p*PW .. p*PW+PW-1 column by column (panel_cpu.h), in the weights' own dtype; the last
   panel's missing features are zeros (never written out). x [rows, in] float32 (the caller
   widens bfloat16 activations); y [rows, out] and bias [out] in the weights' dtype, y summed
   in float32 and rounded once (to nearest even) where bfloat16.

   Why: a decode step's cost is streaming the weights once; the panel multiply reads each
   panel once for every PM rows, with no horizontal sums, and bfloat16 panels at half the
   bytes. Work items are (row chunk, panel): every row of a chunk multiplies one panel while
   it sits in cache, and the weights are streamed once per chunk. A chunk is CHUNK_BYTES of
   float32 activations (L2-resident while a thread walks the panels), but never fewer than
   CHUNK_MIN_ROWS rows: with a 4096-wide input 192 KiB is 12 rows, and 16- to 64-row decode
   steps read a 4096 x 4096 weight from memory 2-6 times (0.73-0.87x oneDNN at 16-512 rows);
   activations past L2 cost little, a row's reads being a sixteenth of the panel's.
   OpenMP over torch's pool (native_cpu.py). */

#include <stdint.h>

#include "panel_cpu.h" /* panel_rows, PW, PM; bf16_cpu.h's widen and narrow */

#define CHUNK_BYTES (192 * 1024) /* activations of a row chunk: half of a Zen 3 L2 */
#define CHUNK_MIN_ROWS (256 / PM * PM)

/* rows of y, PW features from n0 (fewer at the tail): the sums plus the bias, stored */
static inline void store(float (*sums)[PW], int mr, int64_t r, int64_t n0, int64_t width,
                         int64_t out, const void *bias, int is_bf16, void *y) {
    float b[PW] = {0};
    if (bias)
        for (int j = 0; j < width; ++j)
            b[j] = is_bf16 ? widen(((const bf16 *)bias)[n0 + j])
                           : ((const float *)bias)[n0 + j];
    for (int i = 0; i < mr; ++i) {
        const size_t at = (size_t)((r + i) * out + n0);
        if (is_bf16) {
            bf16 *yr = (bf16 *)y + at;
            for (int j = 0; j < width; ++j) yr[j] = narrow(sums[i][j] + b[j]);
        } else {
            float *yr = (float *)y + at;
            for (int j = 0; j < width; ++j) yr[j] = sums[i][j] + b[j];
        }
    }
}

/* x [rows, in] float32; panels [ceil(out / PW), in, PW] and bias [out] (or NULL) and y
   [rows, out]: float32, or bfloat16 when is_bf16. */
void shoal_linear_panels(const float *x, int64_t rows, int64_t in, int64_t out,
                         const void *panels, int64_t is_bf16, const void *bias, void *y) {
    const int64_t n_panels = (out + PW - 1) / PW;
    int64_t chunk = rows;
    if (rows * in * (int64_t)sizeof(float) > CHUNK_BYTES) {
        chunk = CHUNK_BYTES / (in * (int64_t)sizeof(float)) / PM * PM;
        if (chunk < CHUNK_MIN_ROWS) chunk = CHUNK_MIN_ROWS;
    }
    const int64_t n_chunks = (rows + chunk - 1) / chunk;
    const size_t panel_bytes = (size_t)(in * PW) * (is_bf16 ? sizeof(bf16) : sizeof(float));
    const int wbf16 = (int)is_bf16;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_chunks * n_panels; ++item) {
        const int64_t p = item % n_panels, r0 = (item / n_panels) * chunk;
        const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
        const void *panel = (const char *)panels + (size_t)p * panel_bytes;
        const int64_t n0 = p * PW, width = out - n0 < PW ? out - n0 : PW;
        float sums[PM][PW];
        for (int64_t r = r0; r < r1; r += PM) {
            const int mr = r1 - r < PM ? (int)(r1 - r) : PM;
            const float *xr[PM];
            float *outr[PM];
            for (int i = 0; i < mr; ++i) {
                xr[i] = x + (r + i) * in;
                outr[i] = sums[i];
            }
            panel_rows(xr, panel, in, outr, mr, wbf16);
            store(sums, mr, r, n0, width, out, bias, wbf16, y);
        }
    }
}
