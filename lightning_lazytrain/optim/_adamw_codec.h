/* 8-bit codec of the fused AdamW kernel (included by _adamw_kernel.c): the bitsandbytes dynamic map's exact
 * nearest-code encoder and its decoder, vectorized for AVX-512 with the plain search as the fallback, the bucket
 * encoder of the NEON path and the cell encoder of the AVX2 path (_adamw_cell.h). */
static float g_code[2][256], g_thr[2][256];

/* Nearest code = number of decision thresholds strictly below x (ties go to the lower code). The specification
 * the fast encoder is checked against, and its path for the rare values it cannot decide. */
static inline uint8_t encode(int which, float x) {
    int c = 0;
    for (int step = 128; step > 0; step >>= 1) c += (x > g_thr[which][c + step - 1]) ? step : 0;
    return (uint8_t)c;
}

/* Fast encoder. The map is symmetric around 0 (signed) or non-negative (unsigned), so the code follows from c,
 * the count of positive thresholds P below |x|. P splits into runs of evenly spaced thresholds (the map's
 * decades) separated by a few boundary thresholds: the segment holding |x| comes from its binary octave (at most
 * one boundary per octave: one compare), and c from g = |x| * A - B ~ 2^LT_FB * (i + 1) + 1 at the run's
 * threshold P[i], as floor(g) >> LT_FB, capped at the segment's top. g is monotone in x and every threshold is
 * checked (enc_build) to give a g in (2^LT_FB * (i + 1), 2^LT_FB * (i + 1) + 2), so the count is exact unless
 * the low LT_FB bits of floor(g) are 0 or 1; those few values, and NaN and infinities (whose floor(g) converts
 * to INT_MIN), take the binary search. Permutes of 16/32-entry tables, no gathers. */
#define LT_FB 12
#define LT_ONE (float)(1 << LT_FB)
#define LT_OCT0 96 /* octave entry o is exponent LT_OCT0 + o; smaller ones (and zero) share o = 0 */
typedef struct {
    int32_t obound[32]; /* bits of the boundary inside the octave, or INT32_MAX */
    int32_t oseg[32];   /* boundaries below the octave */
    float A[16], B[16];
    int32_t hi[16]; /* c at the segment's top */
    int32_t nneg;   /* thresholds below 0 (mirror images of P[0..nneg-1]) */
    int32_t ok;
} lt_enc;
static lt_enc g_enc[2] __attribute__((aligned(64)));

static float run_g(float x, float A, float B) { return fmaf(x, A, -B); } /* = the kernel's vfmsub */

/* A, B for the run P[r0..r1] above lo (the boundary below, or 0); 0 unless every P[r] lands in its window and
 * lo at or above 2^LT_FB * r0 (so no x of the segment counts below r0). */
static int run_fit(const float *P, int r0, int r1, float lo, float *A, float *B) {
    const double a = LT_ONE * (r1 > r0 ? (double)(r1 - r0) / ((double)P[r1] - P[r0]) : 0.5 / ((double)P[r0] - lo));
    *A = (float)a;
    *B = (float)(a * P[r0] - LT_ONE * (r0 + 1) - 1.0);
    if (!(*A > 0.0f) || !isfinite(*A) || !isfinite(*B) || !(run_g(lo, *A, *B) >= LT_ONE * r0)) return 0;
    for (int r = r0; r <= r1; r++) {
        const float g = run_g(P[r], *A, *B), w = LT_ONE * (r + 1);
        if (!(g > w && g < w + 2.0f)) return 0;
    }
    return 1;
}

static void enc_seg(lt_enc *E, int s, int r0, int r1, const float *P) {
    E->hi[s] = r1 + 1;
    E->A[s] = 0.0f; /* an empty run: g = 2^LT_FB * (r0 + 1/2) */
    E->B[s] = -LT_ONE * (r0 + 0.5f);
    if (r1 >= r0 && !run_fit(P, r0, r1, r0 ? P[r0 - 1] : 0.0f, &E->A[s], &E->B[s])) E->ok = 0;
}

/* Whether the fast encoders can take the map: sorted thresholds, +inf last, the negative ones (*nneg of them)
 * mirror images of the first positive ones, none at 0. */
static int map_ok(const float *thr, int *nneg) {
    int ok = isinf(thr[255]) && thr[255] > 0, n = 0;
    while (n < 255 && thr[n] < 0.0f) n++;
    const float *P = thr + n;
    *nneg = n;
    if (255 - n < n || !(P[0] > 0.0f)) ok = 0;
    for (int k = 0; ok && k < 254; k++) ok = thr[k] < thr[k + 1];
    for (int k = 0; ok && k < n; k++) ok = thr[n - 1 - k] == -P[k];
    return ok;
}

static void enc_build(lt_enc *E, const float *thr) {
    memset(E, 0, sizeof(*E));
    int nneg;
    E->ok = map_ok(thr, &nneg);
    const float *P = thr + nneg;
    const int np = 255 - nneg;
    E->nneg = nneg;
    if (!E->ok) return;
    int bnd[16], nb = 0, r0 = 0;
    for (int i = 0; i < np && E->ok; i++) { /* greedy: grow the run while it fits, else i is a boundary */
        float A, B;
        if (run_fit(P, r0, i, r0 ? P[r0 - 1] : 0.0f, &A, &B)) continue;
        if (nb == 15) { E->ok = 0; return; }
        enc_seg(E, nb, r0, i - 1, P);
        bnd[nb++] = i;
        r0 = i + 1;
    }
    enc_seg(E, nb, r0, np - 1, P);
    for (int o = 0; o < 32; o++) {
        const int64_t lo = o ? (int64_t)(LT_OCT0 + o) << 23 : 0;
        const int64_t hi = o < 31 ? (int64_t)(LT_OCT0 + o + 1) << 23 : INT64_MAX;
        int inside = 0;
        E->oseg[o] = 0;
        E->obound[o] = INT32_MAX;
        for (int k = 0; k < nb; k++) {
            const int64_t b = f2u(P[bnd[k]]);
            E->oseg[o] += b < lo;
            if (b >= lo && b < hi) { inside++; E->obound[o] = (int32_t)b; }
        }
        if (inside > 1) E->ok = 0;
    }
}

/* Bucket encoder (NEON path): the bits of a positive float, from octave LT_OCT0 on, cut into buckets of
 * 2^16 floats (2^LT_BK per octave); bkt_build checks that no bucket holds more than one threshold, so the count
 * below a value is the count below its bucket plus one compare with that threshold, whose high bits are the
 * bucket's: one 32-bit table entry holds the count (high half) and the threshold's low 16 bits (0xffff where the
 * bucket has none, which no value's low bits exceed). Exact by construction, one table load and no search. The first and last buckets, which take every value below and above the
 * octaves, must hold no threshold. */
#define LT_BK 7
#define LT_NBKT (32 << LT_BK)
typedef struct {
    uint32_t entry[LT_NBKT];
    int32_t nneg; /* thresholds below 0 (mirror images of the first nneg of P) */
    int32_t ok;
} lt_bkt;
static lt_bkt g_bkt[2] __attribute__((aligned(64)));

static inline int32_t bkt_index(int32_t a) {
    const int32_t j = (a >> (23 - LT_BK)) - (LT_OCT0 << LT_BK);
    return j < 0 ? 0 : j >= LT_NBKT ? LT_NBKT - 1 : j;
}

static void bkt_build(lt_bkt *K, const float *thr) {
    int nneg;
    K->ok = map_ok(thr, &nneg);
    K->nneg = nneg;
    const float *P = thr + nneg;
    const int np = 255 - nneg;
    int c = 0;
    for (int j = 0; j < LT_NBKT; j++) {
        const int64_t hi = j < LT_NBKT - 1 ? (int64_t)((LT_OCT0 << LT_BK) + j + 1) << (23 - LT_BK) : INT64_MAX;
        const int below = c;
        while (c < np && (int64_t)f2u(P[c]) < hi) c++;
        if (c - below > 1 || (c > below && (j == 0 || j == LT_NBKT - 1))) K->ok = 0;
        K->entry[j] = (uint32_t)below << 16 | (c > below ? f2u(P[below]) & 0xffffu : 0xffffu);
    }
}

/* = encode(which, x) where bkt_build passed. a: the bits counted against the non-negative thresholds P (signed
 * map: |x|, one float up for a negative x, so that ties go to the lower code). NaN gives 0 as encode does. */
static inline uint8_t bkt_encode(int which, float x) {
    const lt_bkt *K = &g_bkt[which];
    const int32_t u = (int32_t)f2u(x), neg = which == 0 && u < 0;
    const int32_t a = which == 0 ? (u & 0x7fffffff) + neg : u;
    if ((u & 0x7fffffff) > 0x7f800000) return 0;
    const uint32_t e = K->entry[bkt_index(a)];
    const int32_t c = (int32_t)(e >> 16) + (((uint32_t)a & 0xffffu) > (e & 0xffffu));
    const int32_t code = neg ? K->nneg - c : K->nneg + c;
    return (uint8_t)(code < 0 ? 0 : code > 255 ? 255 : code);
}

#include "_adamw_cell.h"

#if LT_HAS_AVX512
#define LT_LD(p) _mm512_loadu_si512((const void *)(p))
/* Codes of 16 values as int32, negative for code 0 (the caller packs with unsigned saturation); sgn is a
 * constant after inlining. */
static inline __attribute__((always_inline)) __m512i enc16(const lt_enc *E, __m512 x, int sgn, __mmask16 *unsure) {
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    __mmask16 neg = 0;
    __m512i a = u, e = _mm512_srai_epi32(u, 23);
    if (sgn) { /* a negative x counts the thresholds <= |x| (ties to the lower code): those below the next float */
        neg = _mm512_movepi32_mask(u);
        a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
        a = _mm512_mask_add_epi32(a, neg, a, one);
        e = _mm512_srli_epi32(a, 23);
    } /* unsigned map: a negative x lands in octave 0, below every threshold, where g < 2^LT_FB: code 0 */
    const __m512i o =
        _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(LT_OCT0)), _mm512_set1_epi32(LT_OCT0 + 31));
    __m512i seg = _mm512_permutex2var_epi32(LT_LD(E->oseg), o, LT_LD(E->oseg + 16));
    const __m512i bnd = _mm512_permutex2var_epi32(LT_LD(E->obound), o, LT_LD(E->obound + 16));
    seg = _mm512_mask_add_epi32(seg, _mm512_cmpgt_epi32_mask(a, bnd), seg, one);
    const __m512 g = _mm512_fmsub_ps(_mm512_castsi512_ps(a), _mm512_permutexvar_ps(seg, _mm512_loadu_ps(E->A)),
                                     _mm512_permutexvar_ps(seg, _mm512_loadu_ps(E->B)));
    const __m512i G = _mm512_cvt_roundps_epi32(g, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    *unsure = _mm512_testn_epi32_mask(G, _mm512_set1_epi32((1 << LT_FB) - 2));
    const __m512i c = _mm512_min_epi32(_mm512_srai_epi32(G, LT_FB), _mm512_permutexvar_epi32(seg, LT_LD(E->hi)));
    if (!sgn) return c;
    const __m512i nn = _mm512_set1_epi32(E->nneg);
    return _mm512_mask_sub_epi32(_mm512_add_epi32(nn, c), neg, nn, c);
}

/* Codes of x[0..63] * inv into out[0..63]. */
static inline __attribute__((always_inline)) void enc64(int w, const float *x, float inv, uint8_t *out) {
    const __m512 s = _mm512_set1_ps(inv);
    __mmask16 u0, u1, u2, u3;
    const __m512i c0 = enc16(&g_enc[w], _mm512_mul_ps(_mm512_loadu_ps(x), s), w == 0, &u0);
    const __m512i c1 = enc16(&g_enc[w], _mm512_mul_ps(_mm512_loadu_ps(x + 16), s), w == 0, &u1);
    const __m512i c2 = enc16(&g_enc[w], _mm512_mul_ps(_mm512_loadu_ps(x + 32), s), w == 0, &u2);
    const __m512i c3 = enc16(&g_enc[w], _mm512_mul_ps(_mm512_loadu_ps(x + 48), s), w == 0, &u3);
    /* packs work within 128-bit lanes: dword 4 * lane + k then holds values 16 * k + 4 * lane + 0..3 */
    const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_si512((void *)out, _mm512_permutexvar_epi32(order, b));
    if (__builtin_expect((u0 | u1 | u2 | u3) == 0, 1)) return;
    for (uint64_t left = (uint64_t)u0 | (uint64_t)u1 << 16 | (uint64_t)u2 << 32 | (uint64_t)u3 << 48; left;
         left &= left - 1)
        out[__builtin_ctzll(left)] = encode(w, x[__builtin_ctzll(left)] * inv);
}

static int encoder_ok(int w) { return g_enc[w].ok; }

static int64_t vec_encode(int w, const float *x, uint8_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) w ? enc64(1, x + i, 1.0f, out + i) : enc64(0, x + i, 1.0f, out + i);
    return i;
}
#endif

#if LT_PATH == LT_AVX512VBMI
/* Decoder: the code book as 4 byte planes of 256 entries, looked up 64 codes at a time by byte permutes (two
 * 128-entry halves each), then interleaved back to floats. Codes are pre-shuffled so that the interleave
 * (which works within 128-bit lanes) yields the floats in order. */
static uint8_t g_plane[2][4][256] __attribute__((aligned(64)));
static uint8_t g_shuf[64] __attribute__((aligned(64)));

static inline __attribute__((always_inline)) void dec64(int w, const uint8_t *q, float am, __m512 out[4]) {
    const __m512i c = _mm512_permutexvar_epi8(LT_LD(g_shuf), LT_LD(q));
    const __mmask64 top = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *t = g_plane[w][k];
        b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(LT_LD(t), c, LT_LD(t + 64)),
                                      _mm512_permutex2var_epi8(LT_LD(t + 128), c, LT_LD(t + 192)));
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512 s = _mm512_set1_ps(am);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s);
}
#endif

/* Tables: index 0 = signed map (first moment), 1 = unsigned map (second moment); thr[255] must be +inf. */
void lt_set_tables(const float *code_s, const float *thr_s, const float *code_u, const float *thr_u) {
    memcpy(g_code[0], code_s, sizeof(g_code[0]));
    memcpy(g_code[1], code_u, sizeof(g_code[1]));
    memcpy(g_thr[0], thr_s, sizeof(g_thr[0]));
    memcpy(g_thr[1], thr_u, sizeof(g_thr[1]));
    for (int w = 0; w < 2; w++) {
        enc_build(&g_enc[w], g_thr[w]);
        bkt_build(&g_bkt[w], g_thr[w]);
        cell_build(&g_cell[w], g_thr[w]);
    }
#if LT_PATH == LT_AVX512VBMI
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 256; i++)
            for (int k = 0; k < 4; k++) g_plane[w][k][i] = (uint8_t)(f2u(g_code[w][i]) >> (8 * k));
    for (int lane = 0; lane < 4; lane++)
        for (int k = 0; k < 4; k++)
            for (int q = 0; q < 4; q++) g_shuf[lane * 16 + 4 * k + q] = (uint8_t)(16 * k + 4 * lane + q);
#endif
}

