/* Fused CPU AdamW step for lightning-lazytrain's HybridAdamW.
 *
 * One pass per block of elements: read the gradient (fp32 or bf16, times the clip coefficient), read the moments
 * (fp32, or 8-bit codes + block absmax), update them, update the parameter (fp32, or bf16 with stochastic
 * rounding), write the optional bf16 streaming copy, re-quantize the moments. Blocks are spread over OpenMP
 * threads; the inner loops are plain arrays so the compiler vectorizes them (-O3 -march=native).
 * The arithmetic follows torch.optim.AdamW's single-tensor path operation by operation (fp contraction is off
 * at build time; explicit fmaf only where torch's vectorized lerp and addcmul use one), so fp32 mode matches torch to rounding.
 * Plain C with a ctypes entry point: no torch headers, so building takes about a second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef struct {
    float *p32;          /* fp32 master, or NULL */
    uint16_t *p16;       /* bf16 master (stochastic rounding), or NULL */
    const void *grad;    /* fp32 or bf16 gradient */
    int32_t grad_bf16;
    int32_t nthreads;
    float *m, *v;        /* fp32 moments, or NULL */
    uint8_t *mq, *vq;    /* 8-bit moment codes, or NULL */
    float *mabs, *vabs;  /* per-block absmax of the 8-bit moments */
    uint16_t *copy;      /* bf16 streaming copy, or NULL */
    int64_t n, block;
    float decay;         /* 1 - lr * weight_decay */
    float w1;            /* 1 - beta1 (lerp weight) */
    float beta2, w2;     /* beta2, 1 - beta2 */
    float neg_step;      /* -lr / (1 - beta1^t) */
    float bc2_sqrt, eps, grad_scale;
    uint32_t sr_key;
} lt_args;

static float g_code[2][256], g_thr[2][256];

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t bf16_rne(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch writes it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Counter-based hash: the noise of element i depends only on (key, i), so results do not depend on threads. */
static inline uint32_t lt_mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

static inline uint16_t bf16_stochastic(float f, uint32_t key, int64_t i) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return bf16_rne(f);
    uint32_t r = lt_mix(((uint32_t)i * 0x9e3779b9u) ^ key) & 0xffffu;
    return (uint16_t)((u + r) >> 16);
}

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
 * one boundary per octave: one compare), and c from floor(f), f = |x| * A - B ~ i + 1 at the run's threshold
 * P[i], clamped to the segment's top. f is monotone in x and every threshold is checked (enc_build) to lie
 * within LT_MARGIN of its integer, so floor(f) is exact whenever f is at least LT_MARGIN from an integer; the
 * few other values take the binary search. Permutes of 16/32-entry tables, no gathers. */
#define LT_MARGIN 0x1p-12f
#define LT_OCT0 96 /* octave entry o is exponent LT_OCT0 + o; smaller ones (and zero) share o = 0 */
#define LT_INF 0x7f800000
typedef struct {
    int32_t obound[32]; /* bits of the boundary inside the octave, or INT32_MAX; the top one is +inf */
    int32_t oseg[32];   /* boundaries below the octave */
    float A[16], B[16];
    uint32_t hi[16]; /* c of the segment's top; the segment above +inf (NaN) gets INT_MIN, packed to code 0 */
    int32_t nneg;    /* thresholds below 0 (mirror images of P[0..nneg-1]) */
    int32_t ok;
} lt_enc;
static lt_enc g_enc[2] __attribute__((aligned(64)));

static float run_f(float x, float A, float B) { return fmaf(x, A, -B); } /* = the kernel's vfmsub */

/* A, B for the run P[r0..r1] above lo (the boundary below, or 0); 0 unless every P[r] maps to within LT_MARGIN
 * of r + 1 and lo to at least r0 (so no x of the segment floors below its first count). */
static int run_fit(const float *P, int r0, int r1, float lo, float *A, float *B) {
    const double a = r1 > r0 ? (double)(r1 - r0) / ((double)P[r1] - P[r0]) : 0.5 / ((double)P[r0] - lo);
    *A = (float)a;
    *B = (float)(a * P[r0] - (r0 + 1));
    if (!(*A > 0.0f) || !isfinite(*A) || !isfinite(*B) || !(run_f(lo, *A, *B) >= (float)r0)) return 0;
    for (int r = r0; r <= r1; r++)
        if (!(fabsf(run_f(P[r], *A, *B) - (float)(r + 1)) < LT_MARGIN)) return 0;
    return 1;
}

static void enc_seg(lt_enc *E, int s, int r0, int r1, const float *P) {
    E->hi[s] = (uint32_t)(r1 + 1);
    E->A[s] = 0.0f; /* an empty run: f = r0 + 0.5, never near an integer */
    E->B[s] = -(r0 + 0.5f);
    if (r1 >= r0 && !run_fit(P, r0, r1, r0 ? P[r0 - 1] : 0.0f, &E->A[s], &E->B[s])) E->ok = 0;
}

static void enc_build(lt_enc *E, const float *thr) {
    memset(E, 0, sizeof(*E));
    E->ok = isinf(thr[255]) && thr[255] > 0;
    int nneg = 0;
    while (nneg < 255 && thr[nneg] < 0.0f) nneg++;
    const float *P = thr + nneg;
    const int np = 255 - nneg;
    E->nneg = nneg;
    if (np < nneg || !(P[0] > 0.0f)) E->ok = 0;
    for (int k = 0; E->ok && k < 254; k++) E->ok = thr[k] < thr[k + 1];
    for (int k = 0; E->ok && k < nneg; k++) E->ok = thr[nneg - 1 - k] == -P[k];
    if (!E->ok) return;
    int bnd[16], nb = 0, r0 = 0;
    for (int i = 0; i < np && E->ok; i++) { /* greedy: grow the run while it fits, else i is a boundary */
        float A, B;
        if (run_fit(P, r0, i, r0 ? P[r0 - 1] : 0.0f, &A, &B)) continue;
        if (nb == 14) { E->ok = 0; return; }
        enc_seg(E, nb, r0, i - 1, P);
        bnd[nb++] = i;
        r0 = i + 1;
    }
    enc_seg(E, nb, r0, np - 1, P);
    E->hi[nb + 1] = 0x80000000u; /* A = 0: f is NaN for NaN input */
    for (int o = 0; o < 32; o++) {
        const int64_t lo = o ? (int64_t)(LT_OCT0 + o) << 23 : 0;
        const int64_t hi = o < 31 ? (int64_t)(LT_OCT0 + o + 1) << 23 : INT64_MAX;
        int inside = 0;
        E->oseg[o] = 0;
        E->obound[o] = o < 31 ? INT32_MAX : LT_INF;
        for (int k = 0; k < nb; k++) {
            const int64_t b = f2u(P[bnd[k]]);
            E->oseg[o] += b < lo;
            if (b >= lo && b < hi) { inside++; E->obound[o] = (int32_t)b; }
        }
        if (inside > (o < 31)) E->ok = 0; /* the top octave's only boundary is +inf */
    }
}

#ifdef __AVX512F__
#define LT_LD(p) _mm512_loadu_si512((const void *)(p))
/* Codes of 16 values as int32, negative for code 0 of some lanes (the caller packs with unsigned saturation);
 * sgn is a constant after inlining. */
static inline __attribute__((always_inline)) __m512i enc16(const lt_enc *E, __m512 x, int sgn, __mmask16 *unsure) {
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    const __mmask16 neg = _mm512_movepi32_mask(u);
    __m512i a = u; /* unsigned map: a negative x is code 0 whatever its count */
    if (sgn) { /* a negative x counts the thresholds <= |x| (ties to the lower code): those below the next float */
        a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
        a = _mm512_mask_add_epi32(a, neg, a, one);
    }
    const __m512i o = _mm512_min_epi32(_mm512_max_epi32(_mm512_srli_epi32(a, 23), _mm512_set1_epi32(LT_OCT0)),
                                       _mm512_set1_epi32(LT_OCT0 + 31));
    __m512i seg = _mm512_permutex2var_epi32(LT_LD(E->oseg), o, LT_LD(E->oseg + 16));
    const __m512i bnd = _mm512_permutex2var_epi32(LT_LD(E->obound), o, LT_LD(E->obound + 16));
    seg = _mm512_mask_add_epi32(seg, _mm512_cmpgt_epi32_mask(a, bnd), seg, one);
    const __m512 f = _mm512_fmsub_ps(_mm512_castsi512_ps(a), _mm512_permutexvar_ps(seg, _mm512_loadu_ps(E->A)),
                                     _mm512_permutexvar_ps(seg, _mm512_loadu_ps(E->B)));
    /* NaN and overflow convert to INT_MIN, which the unsigned min turns into the segment's top */
    const __m512i c = _mm512_min_epu32(_mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                       _mm512_permutexvar_epi32(seg, LT_LD(E->hi)));
    *unsure = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_reduce_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                                 _mm512_set1_ps(LT_MARGIN), _CMP_LT_OQ);
    if (!sgn) return _mm512_mask_sub_epi32(c, neg, _mm512_setzero_si512(), c);
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
    const uint64_t unsure = (uint64_t)u0 | (uint64_t)u1 << 16 | (uint64_t)u2 << 32 | (uint64_t)u3 << 48;
    if (__builtin_expect(unsure != 0, 0))
        for (int l = 0; l < 64; l++)
            if (unsure >> l & 1) out[l] = encode(w, x[l] * inv);
}
#endif

/* Codes of x[0..n) (already divided by their absmax): the kernel's encoder, exposed for the tests. */
void lt_encode(int which, const float *x, uint8_t *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (g_enc[which].ok)
        for (; i + 64 <= n; i += 64) which ? enc64(1, x + i, 1.0f, out + i) : enc64(0, x + i, 1.0f, out + i);
#endif
    for (; i < n; i++) out[i] = encode(which, x[i]);
}

int lt_fast_encoder(void) {
#ifdef __AVX512F__
    return g_enc[0].ok && g_enc[1].ok;
#else
    return 0;
#endif
}

#ifdef __AVX512VBMI__
/* Decoder: the code book as 4 byte planes of 256 entries, looked up 64 codes at a time by byte permutes (two
 * 128-entry halves each), then interleaved back to floats. Codes are pre-shuffled so that the interleave
 * (which works within 128-bit lanes) yields the floats in order. */
static uint8_t g_plane[2][4][256] __attribute__((aligned(64)));
static uint8_t g_shuf[64] __attribute__((aligned(64)));

static inline void dec64(int w, const uint8_t *q, float am, float *out) {
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
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
    _mm512_storeu_ps(out + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
}
#endif

/* Tables: index 0 = signed map (first moment), 1 = unsigned map (second moment); thr[255] must be +inf. */
void lt_set_tables(const float *code_s, const float *thr_s, const float *code_u, const float *thr_u) {
    memcpy(g_code[0], code_s, sizeof(g_code[0]));
    memcpy(g_code[1], code_u, sizeof(g_code[1]));
    memcpy(g_thr[0], thr_s, sizeof(g_thr[0]));
    memcpy(g_thr[1], thr_u, sizeof(g_thr[1]));
    for (int w = 0; w < 2; w++) enc_build(&g_enc[w], g_thr[w]);
#ifdef __AVX512VBMI__
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 256; i++)
            for (int k = 0; k < 4; k++) g_plane[w][k][i] = (uint8_t)(f2u(g_code[w][i]) >> (8 * k));
    for (int lane = 0; lane < 4; lane++)
        for (int k = 0; k < 4; k++)
            for (int q = 0; q < 4; q++) g_shuf[lane * 16 + 4 * k + q] = (uint8_t)(16 * k + 4 * lane + q);
#endif
}

/* The update proper, reading the big arrays in place: streaming all of them side by side keeps the hardware
 * prefetchers on (copying each into scratch first made this pass memory-latency bound, ~3x slower).
 * m, v point at the fp32 states, or at the block's scratch holding decoded 8-bit states. */
#define LT_UPDATE_LOOP(LOAD_G, LOAD_P, STORE_P)                                \
    for (int64_t i = 0; i < len; i++) {                                       \
        const float gi = (LOAD_G) * sc;                                       \
        const float mi = fmaf(w1, gi - m[i], m[i]);                           \
        const float vi = fmaf(w2 * gi, gi, v[i] * b2); /* = torch addcmul */  \
        const float denom = sqrtf(vi) / bc2 + eps;                            \
        const float pi = (LOAD_P) * decay;                                    \
        const float pn = pi + ns * mi / denom;                                \
        STORE_P;                                                              \
        m[i] = mi;                                                            \
        v[i] = vi;                                                            \
    }

static void do_block(const lt_args *a, int64_t s, int64_t len, float *restrict sm, float *restrict sv) {
    const int64_t blk = s / a->block;
    float *restrict m = a->mq ? sm : a->m + s;
    float *restrict v = a->mq ? sv : a->v + s;
    if (a->mq) {
        const float am = a->mabs[blk], av = a->vabs[blk];
        const uint8_t *mq = a->mq + s, *vq = a->vq + s;
        int64_t i = 0;
#ifdef __AVX512VBMI__
        for (; i + 64 <= len; i += 64) {
            dec64(0, mq + i, am, m + i);
            dec64(1, vq + i, av, v + i);
        }
#endif
        for (; i < len; i++) {
            m[i] = g_code[0][mq[i]] * am;
            v[i] = g_code[1][vq[i]] * av;
        }
    }
    const float decay = a->decay, w1 = a->w1, b2 = a->beta2, w2 = a->w2;
    const float ns = a->neg_step, bc2 = a->bc2_sqrt, eps = a->eps, sc = a->grad_scale;
    const float *restrict g32 = (const float *)a->grad + s;
    const uint16_t *restrict g16 = (const uint16_t *)a->grad + s;
    uint16_t *restrict cp = a->copy ? a->copy + s : NULL;
    if (a->p32) {
        float *restrict p = a->p32 + s;
        if (a->grad_bf16 && cp) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), p[i], (p[i] = pn, cp[i] = bf16_rne(pn)))
        } else if (a->grad_bf16) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), p[i], p[i] = pn)
        } else if (cp) {
            LT_UPDATE_LOOP(g32[i], p[i], (p[i] = pn, cp[i] = bf16_rne(pn)))
        } else {
            LT_UPDATE_LOOP(g32[i], p[i], p[i] = pn)
        }
    } else {
        uint16_t *restrict p = a->p16 + s;
        const uint32_t key = a->sr_key;
        if (a->grad_bf16) {
            LT_UPDATE_LOOP(u2f((uint32_t)g16[i] << 16), u2f((uint32_t)p[i] << 16),
                           p[i] = bf16_stochastic(pn, key, s + i))
        } else {
            LT_UPDATE_LOOP(g32[i], u2f((uint32_t)p[i] << 16), p[i] = bf16_stochastic(pn, key, s + i))
        }
        if (cp) memcpy(cp, p, (size_t)len * 2);
    }
    if (a->mq) {
        float am = 0.0f, av = 0.0f;
        int64_t i0 = 0;
#ifdef __AVX512F__
        __m512 xam = _mm512_setzero_ps(), xav = _mm512_setzero_ps();
        for (; i0 + 16 <= len; i0 += 16) {
            xam = _mm512_max_ps(xam, _mm512_abs_ps(_mm512_loadu_ps(m + i0)));
            xav = _mm512_max_ps(xav, _mm512_loadu_ps(v + i0));
        }
        am = _mm512_reduce_max_ps(xam);
        av = _mm512_reduce_max_ps(xav);
#endif
        for (int64_t i = i0; i < len; i++) {
            const float x = fabsf(m[i]);
            am = x > am ? x : am;
            av = v[i] > av ? v[i] : av;
        }
        a->mabs[blk] = am;
        a->vabs[blk] = av;
        const float im = am > 0.0f ? 1.0f / am : 0.0f, iv = av > 0.0f ? 1.0f / av : 0.0f;
        uint8_t *mq = a->mq + s, *vq = a->vq + s;
        i0 = 0;
#ifdef __AVX512F__
        if (g_enc[0].ok && g_enc[1].ok)
            for (; i0 + 64 <= len; i0 += 64) {
                enc64(0, m + i0, im, mq + i0);
                enc64(1, v + i0, iv, vq + i0);
            }
#endif
        for (int64_t i = i0; i < len; i++) {
            mq[i] = encode(0, m[i] * im);
            vq[i] = encode(1, v[i] * iv);
        }
    }
}

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int lt_adamw_step(const lt_args *a) {
    const int64_t bs = a->block;
    const int64_t nblk = (a->n + bs - 1) / bs;
    int nt = a->nthreads > 0 ? a->nthreads : 1;
    if (nblk < nt) nt = (int)(nblk > 0 ? nblk : 1);
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *scratch = (float *)aligned_alloc(64, (size_t)(((bs * 8 + 63) / 64) * 64));
        if (!scratch) {
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            if (!scratch) continue;
            const int64_t s = b * bs;
            const int64_t len = (s + bs <= a->n) ? bs : a->n - s;
            do_block(a, s, len, scratch, scratch + bs);
        }
        free(scratch);
    }
    return failed;
}
