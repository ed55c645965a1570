/* Cell encoder (AVX2 path, _adamw_avx2.h; included by _adamw_codec.h): the exact count of the AVX-512 encoder
 * from register-held tables of 8 and 16 entries. A float's magnitude bits with top byte LT_CELL0 + k (k in 0..15;
 * smaller ones: no boundary below) fall in cell k, 2 binades wide; cell_build checks each cell holds at most one of
 * the boundaries between the runs of evenly spaced thresholds, so the segment of |x| is the boundaries below its
 * cell plus one compare with the next boundary. In segment s, G = g rounded to nearest, g = |x| * A - B, counts
 * the run's thresholds below |x| as G >> LT_FB, capped at the segment's top: every run threshold P[r] has g in
 * (2^LT_FB * (r + 1) + 1/2, 2^LT_FB * (r + 1) + 3) (checked), so the count is exact unless G's bits 2..LT_FB-1
 * are all zero; those values, and NaN (G = INT_MIN), take the binary search. |x| < 2 is assumed (lt_encode
 * clamps). */
#define LT_CELL0 48
typedef struct {
    uint8_t seglo[32]; /* boundaries below cell k, at k and 16 + k (a byte shuffle's two lanes) */
    int32_t bnd[8];    /* bits of boundary s, INT32_MAX past the last */
    float A[8], B[8];
    int32_t hi[8]; /* the count at segment s's top */
    int32_t nneg, ok;
} lt_cell;
static lt_cell g_cell[2] __attribute__((aligned(32)));

/* Line of segment s (run P[r0..r1] above lo) and whether every run threshold lands in its window. */
static int cell_fit(lt_cell *K, int s, const float *P, int r0, int r1, float lo) {
    K->hi[s] = r1 + 1;
    if (r1 < r0) { /* no run: the count is r0 throughout */
        K->A[s] = 0.0f;
        K->B[s] = -LT_ONE * (r0 + 0.5f);
        return 1;
    }
    const double a = LT_ONE * (r1 > r0 ? (r1 - r0) / ((double)P[r1] - P[r0]) : 1.0 / ((double)P[r0] - lo));
    K->A[s] = (float)a;
    K->B[s] = (float)(a * P[r0] - LT_ONE * (r0 + 1) - 2.0);
    if (!(K->A[s] > 0.0f) || !isfinite(K->A[s]) || !isfinite(K->B[s])) return 0;
    if (!(fmaf(lo, K->A[s], -K->B[s]) >= LT_ONE * r0)) return 0;
    for (int r = r0; r <= r1; r++) {
        const float g = fmaf(P[r], K->A[s], -K->B[s]), w = LT_ONE * (r + 1);
        if (!(g > w + 0.5f && g < w + 3.0f)) return 0;
    }
    return 1;
}

static void cell_build(lt_cell *K, const float *thr) {
    memset(K, 0, sizeof(*K));
    int nneg;
    K->ok = map_ok(thr, &nneg);
    K->nneg = nneg;
    const float *P = thr + nneg;
    const int np = 255 - nneg;
    if (!K->ok || !(P[np - 1] < 1.5f)) { K->ok = 0; return; }
    int bnd[8], nb = 0, r0 = 0;
    for (int i = 0; i < np; i++) { /* greedy: grow the run while it fits, else i is a boundary */
        if (cell_fit(K, nb, P, r0, i, r0 ? P[r0 - 1] : 0.0f)) continue;
        if (nb == 7) { K->ok = 0; return; }
        cell_fit(K, nb, P, r0, i - 1, r0 ? P[r0 - 1] : 0.0f);
        bnd[nb++] = i;
        r0 = i + 1;
    }
    K->ok = cell_fit(K, nb, P, r0, np - 1, r0 ? P[r0 - 1] : 0.0f);
    for (int s = nb + 1; s < 8; s++) { K->A[s] = K->A[nb]; K->B[s] = K->B[nb]; K->hi[s] = K->hi[nb]; }
    for (int s = 0; s < 8; s++) K->bnd[s] = s < nb ? (int32_t)f2u(P[bnd[s]]) : INT32_MAX;
    for (int k = 0; k < 16; k++) {
        const int64_t lo = k ? (int64_t)(LT_CELL0 + k) << 24 : 0, hi = (int64_t)(LT_CELL0 + k + 1) << 24;
        int inside = 0;
        for (int s = 0; s < nb; s++) {
            K->seglo[k] += K->bnd[s] < lo;
            inside += K->bnd[s] >= lo && K->bnd[s] < hi;
        }
        K->seglo[16 + k] = K->seglo[k];
        if (inside > 1) K->ok = 0;
    }
}
