/* The 8-bit blocks of the AVX2+FMA path of _adamw_kernel.c (included there after the per-block passes it
 * matches bit for bit): one loop decodes and updates block b and re-encodes block b - 1 with the cell encoder
 * (_adamw_cell.h), whose table lookups are register permutes: no gathers (8 scalar loads and inserts cost half a
 * gather of 8 on Zen 4; the bucket encoder's gathers cost 0.9 ns per parameter there). A block's last len % 32
 * elements take the scalar code (tail8). */

#if LT_PATH == LT_AVX2
#define LT_I8(x) _mm256_set1_epi32((int)(x))

static inline __m256i v8_bf16_rne(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), LT_I8(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(LT_I8(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, LT_I8(0x7fffffff)), LT_I8(0x7f800000));
    return _mm256_blendv_epi8(r, LT_I8(0x7fc0), nan);
}

static inline __m256i v8_mix(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, LT_I8(0x7feb352du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, LT_I8(0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

static inline __m256i v8_bf16_stochastic(__m256i u, uint32_t key, int64_t i) {
    const __m256i idx = _mm256_add_epi32(LT_I8((uint32_t)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i r = _mm256_and_si256(v8_mix(_mm256_xor_si256(_mm256_mullo_epi32(idx, LT_I8(0x9e3779b9u)),
                                                               LT_I8(key))),
                                       LT_I8(0xffff));
    /* |x| >= +inf: round to nearest (NaN, infinities), as bf16_stochastic does */
    const __m256i special = _mm256_cmpgt_epi32(_mm256_and_si256(u, LT_I8(0x7fffffff)), LT_I8(0x7f7fffff));
    return _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, r), 16), v8_bf16_rne(u), special);
}

static inline __m256 v8_load_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline void v8_store_u16(uint16_t *p, __m256i x) { /* x: 8 values below 2^16 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

#define LT_LD8(p) _mm256_load_si256((const __m256i *)(p))
/* Codes of 8 values as int32 (the caller packs with saturation) by the cell encoder (_adamw_codec.h); *low: 0 in
 * the lanes it cannot decide. w is a constant after inlining. */
static inline __attribute__((always_inline)) __m256i v8_encode(int w, __m256 x, __m256i *low) {
    const lt_cell *K = &g_cell[w];
    const __m256i u = _mm256_castps_si256(x);
    /* signed map: |x|; unsigned map: a negative x (NaN included) as 0, its code 0 */
    const __m256i mag = w == 0 ? _mm256_and_si256(u, LT_I8(0x7fffffff)) : _mm256_max_epi32(u, _mm256_setzero_si256());
    /* a negative x counts the boundaries at or below |x|, those below the next float (a sure |x| is no run
     * threshold, so the line's count is that too); a NaN's wraps, harmless: its G is INT_MIN */
    const __m256i up = w == 0 ? _mm256_sub_epi32(mag, _mm256_srai_epi32(u, 31)) : mag;
    /* a byte shuffle: the index's bit 7, set below cell 0 and in the upper bytes there, gives 0, no boundary */
    const __m256i lo = _mm256_shuffle_epi8(LT_LD8(K->seglo), _mm256_sub_epi32(_mm256_srli_epi32(mag, 24), LT_I8(LT_CELL0)));
    const __m256i seg = _mm256_sub_epi32(lo, _mm256_cmpgt_epi32(up, _mm256_permutevar8x32_epi32(LT_LD8(K->bnd), lo)));
    const __m256 g = _mm256_fmsub_ps(_mm256_castsi256_ps(mag), _mm256_permutevar8x32_ps(_mm256_load_ps(K->A), seg),
                                     _mm256_permutevar8x32_ps(_mm256_load_ps(K->B), seg));
    const __m256i G = _mm256_cvtps_epi32(g);
    *low = _mm256_and_si256(G, LT_I8((1 << LT_FB) - 4));
    const __m256i c = _mm256_min_epi32(_mm256_srai_epi32(G, LT_FB), _mm256_permutevar8x32_epi32(LT_LD8(K->hi), seg));
    return w == 0 ? _mm256_add_epi32(LT_I8(K->nneg), _mm256_sign_epi32(c, u)) : c; /* sign: -c where x < 0 */
}

/* The lanes of out[0..31] the cell encoder left undecided, by the search. */
static __attribute__((noinline)) void v8_undecided(int w, const float *x, float inv, uint8_t *out) {
    for (int k = 0; k < 32; k += 8) {
        __m256i low;
        v8_encode(w, _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(inv)), &low);
        const __m256i zero = _mm256_cmpeq_epi32(low, _mm256_setzero_si256());
        for (int lanes = _mm256_movemask_ps(_mm256_castsi256_ps(zero)); lanes; lanes &= lanes - 1)
            out[k + __builtin_ctz(lanes)] = encode(w, x[k + __builtin_ctz(lanes)] * inv);
    }
}

/* Codes of x[0..31] * inv into out[0..31]. */
static inline __attribute__((always_inline)) void v8_encode32(int w, const float *x, float inv, uint8_t *out) {
    const __m256 s = _mm256_set1_ps(inv);
    __m256i c[4], low[4];
    for (int k = 0; k < 4; k++) c[k] = v8_encode(w, _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), s), &low[k]);
    /* the packs work within 128-bit lanes: dword 2 * k + lane holds values 8 * k + 4 * lane + 0..3 */
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(b, order));
    const __m256i zero = _mm256_cmpeq_epi32(
        _mm256_min_epu32(_mm256_min_epu32(low[0], low[1]), _mm256_min_epu32(low[2], low[3])), _mm256_setzero_si256());
    if (__builtin_expect(!_mm256_testz_si256(zero, zero), 0)) v8_undecided(w, x, inv, out);
}

/* 8 elements at i of the update; g16, p16, cp are constants after inlining. */
static inline __attribute__((always_inline)) void v8_update(const lt_args *a, int64_t i, __m256 *m, __m256 *v,
                                                            int g16, int p16, int cp) {
    const __m256 g = _mm256_mul_ps(g16 ? v8_load_bf16((const uint16_t *)a->grad + i)
                                       : _mm256_loadu_ps((const float *)a->grad + i),
                                   _mm256_set1_ps(a->grad_scale));
    const __m256 mi = _mm256_fmadd_ps(_mm256_set1_ps(a->w1), _mm256_sub_ps(g, *m), *m);
    const __m256 vr = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(a->w2), g), g,
                                      _mm256_mul_ps(*v, _mm256_set1_ps(a->beta2)));
    /* max_ps(f, vr) = f > vr ? f : vr: LT_UPDATE_LOOP's floor */
    const __m256 vi = _mm256_max_ps(_mm256_mul_ps(_mm256_mul_ps(mi, mi), _mm256_set1_ps(a->v_floor)), vr);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(a->bc2_sqrt)),
                                       _mm256_set1_ps(a->eps));
    const __m256 p = p16 ? v8_load_bf16(a->p16 + i) : _mm256_loadu_ps(a->p32 + i);
    const __m256 pn = _mm256_add_ps(_mm256_mul_ps(p, _mm256_set1_ps(a->decay)),
                                    _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(a->neg_step), mi), denom));
    if (p16) {
        const __m256i b = v8_bf16_stochastic(_mm256_castps_si256(pn), a->sr_key, i);
        v8_store_u16(a->p16 + i, b);
        if (cp) v8_store_u16(a->copy + i, b);
    } else {
        _mm256_storeu_ps(a->p32 + i, pn);
        if (cp) v8_store_u16(a->copy + i, v8_bf16_rne(_mm256_castps_si256(pn)));
    }
    *m = mi;
    *v = vi;
}

/* Scalar loads and inserts: a gather of 8 floats costs about twice as much on Zen 4 (measured). */
static inline __m256 v8_decode(int w, const uint8_t *q, __m256 am) {
    const float *t = g_code[w];
    uint64_t c;
    memcpy(&c, q, 8);
    const __m128 lo = _mm_setr_ps(t[c & 255], t[(c >> 8) & 255], t[(c >> 16) & 255], t[(c >> 24) & 255]);
    const __m128 hi = _mm_setr_ps(t[(c >> 32) & 255], t[(c >> 40) & 255], t[(c >> 48) & 255], t[c >> 56]);
    return _mm256_mul_ps(_mm256_set_m128(hi, lo), am);
}

/* Blocks [b0, b1) of an 8-bit tensor in one loop: per 32 elements, decode and update block b (the operations of
 * LT_UPDATE_LOOP in its order), keep its new moments in scratch and their absmax in registers, and re-encode
 * block b - 1, whose absmax is known by then: the update's divider work overlaps the encoder's. scratch holds two
 * blocks' m and v; the last len % 32 elements of a block take the scalar code. */
static inline __attribute__((always_inline)) void v8_blocks(const lt_args *a, int64_t b0, int64_t b1,
                                                            float *scratch, int g16, int p16, int cp) {
    const lt_args local = *a; /* a copy the stores cannot alias: scalars and pointers stay in registers */
    a = &local;
    const int64_t bs = a->block;
    int64_t qs = 0, qlen = 0; /* block b - 1, waiting to be re-encoded */
    float qim = 0.0f, qiv = 0.0f;
    for (int64_t b = b0; b <= b1; b++) { /* b1: only re-encodes b1 - 1 */
        float *sm = scratch + (b & 1) * 2 * bs, *sv = sm + bs, *om = scratch + ((b + 1) & 1) * 2 * bs, *ov = om + bs;
        const int64_t s = b * bs, len = b == b1 ? 0 : s + bs <= a->n ? bs : a->n - s;
        const int64_t nfull = len & ~(int64_t)31, qfull = qlen & ~(int64_t)31, kend = nfull > qfull ? nfull : qfull;
        const __m256 am = _mm256_set1_ps(len ? a->mabs[b] : 0.0f), av = _mm256_set1_ps(len ? a->vabs[b] : 0.0f);
        __m256 xam = _mm256_setzero_ps(), xav = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int64_t k = 0; k < kend; k += 32) {
            if (k < nfull) { /* 4 independent updates: their divider chains overlap */
                const int64_t ahead = s + bs + k; /* the next block's masters and gradients, into the cache */
                _mm_prefetch(p16 ? (const char *)(a->p16 + ahead) : (const char *)(a->p32 + ahead), _MM_HINT_T0);
                _mm_prefetch((const char *)a->grad + ahead * (g16 ? 2 : 4), _MM_HINT_T0);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    __m256 m = v8_decode(0, a->mq + s + k + 8 * j, am), v = v8_decode(1, a->vq + s + k + 8 * j, av);
                    v8_update(a, s + k + 8 * j, &m, &v, g16, p16, cp);
                    _mm256_storeu_ps(sm + k + 8 * j, m);
                    _mm256_storeu_ps(sv + k + 8 * j, v);
                    xam = _mm256_max_ps(_mm256_andnot_ps(sign, m), xam); /* = x > am ? x : am lane-wise: skips NaN */
                    xav = _mm256_max_ps(v, xav);
                }
            }
            if (k < qfull) {
                v8_encode32(0, om + k, qim, a->mq + qs + k);
                v8_encode32(1, ov + k, qiv, a->vq + qs + k);
            }
        }
        for (int64_t i = qfull; i < qlen; i++) {
            a->mq[qs + i] = encode(0, om[i] * qim);
            a->vq[qs + i] = encode(1, ov[i] * qiv);
        }
        if (!len) break;
        float lm[8], lv[8], inv[2];
        _mm256_storeu_ps(lm, xam);
        _mm256_storeu_ps(lv, xav);
        tail8(a, s, nfull, len, sm, sv, lm, lv, 8, inv);
        qs = s;
        qlen = len;
        qim = inv[0];
        qiv = inv[1];
    }
}

/* Blocks [b0, b1) of an 8-bit tensor; scratch holds two blocks' m and v. */
static void do_blocks8(const lt_args *a, int64_t b0, int64_t b1, float *scratch) {
    const int g16 = a->grad_bf16 != 0, p16 = a->p16 != NULL, cp = a->copy != NULL;
    switch (g16 | p16 << 1 | cp << 2) {
    case 0: v8_blocks(a, b0, b1, scratch, 0, 0, 0); break;
    case 1: v8_blocks(a, b0, b1, scratch, 1, 0, 0); break;
    case 2: v8_blocks(a, b0, b1, scratch, 0, 1, 0); break;
    case 3: v8_blocks(a, b0, b1, scratch, 1, 1, 0); break;
    case 4: v8_blocks(a, b0, b1, scratch, 0, 0, 1); break;
    case 5: v8_blocks(a, b0, b1, scratch, 1, 0, 1); break;
    case 6: v8_blocks(a, b0, b1, scratch, 0, 1, 1); break;
    default: v8_blocks(a, b0, b1, scratch, 1, 1, 1); break;
    }
}

static int encoder_ok(int w) { return g_cell[w].ok; }

/* The cell encoder of the tests' lt_encode: codes of x[0..n), 32 at a time; returns how many it wrote. Values
 * are first clamped to [-1.5, 1.5], NaN kept (no threshold but +inf lies outside, cell_build checks): the same
 * codes, and inside the cells' range, as the kernel's values (at most the block absmax times its reciprocal). */
static int64_t vec_encode(int w, const float *x, uint8_t *out, int64_t n) {
    int64_t i = 0;
    float c[32] __attribute__((aligned(32)));
    for (; i + 32 <= n; i += 32) {
        for (int k = 0; k < 32; k += 8) /* max_ps and min_ps return their second operand where one is NaN */
            _mm256_store_ps(c + k, _mm256_min_ps(_mm256_set1_ps(1.5f),
                                                 _mm256_max_ps(_mm256_set1_ps(-1.5f), _mm256_loadu_ps(x + i + k))));
        w ? v8_encode32(1, c, 1.0f, out + i) : v8_encode32(0, c, 1.0f, out + i);
    }
    return i;
}
#endif
