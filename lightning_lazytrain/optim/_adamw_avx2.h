/* The 8-bit blocks of the AVX2+FMA path of _adamw_kernel.c (included there after the per-block passes it
 * matches bit for bit): per block, one loop decodes 8 codes of each moment (gathers from the code book), updates
 * them and the parameter (the operations of LT_UPDATE_LOOP in its order) and keeps the new moments in scratch
 * with their absmax; a second loop re-encodes them with the bucket encoder (_adamw_codec.h), 32 at a time. A
 * block's last len % 32 elements take the scalar code. */

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

/* Scalar loads and inserts: a gather of 8 floats costs about twice as much on Zen 4 (measured). */
static inline __m256 v8_decode(int w, const uint8_t *q, float am) {
    const float *t = g_code[w];
    uint64_t c;
    memcpy(&c, q, 8);
    const __m128 lo = _mm_setr_ps(t[c & 255], t[(c >> 8) & 255], t[(c >> 16) & 255], t[(c >> 24) & 255]);
    const __m128 hi = _mm_setr_ps(t[(c >> 32) & 255], t[(c >> 40) & 255], t[(c >> 48) & 255], t[c >> 56]);
    return _mm256_mul_ps(_mm256_set_m128(hi, lo), _mm256_set1_ps(am));
}

/* Codes of 8 values as int32 (the caller packs with saturation): bkt_encode lane by lane; w is a constant. */
static inline __m256i v8_encode(int w, __m256 x) {
    const lt_bkt *K = &g_bkt[w];
    const __m256i u = _mm256_castps_si256(x), mag = _mm256_and_si256(u, LT_I8(0x7fffffff));
    const __m256i negm = _mm256_srai_epi32(u, 31); /* -1 where x < 0 */
    const __m256i a = w == 0 ? _mm256_sub_epi32(mag, negm) : u;
    __m256i j = _mm256_sub_epi32(_mm256_srai_epi32(a, 23 - LT_BK), LT_I8(LT_OCT0 << LT_BK));
    j = _mm256_min_epi32(_mm256_max_epi32(j, _mm256_setzero_si256()), LT_I8(LT_NBKT - 1));
    const __m256i e = _mm256_i32gather_epi32((const int *)K->entry, j, 4), low = LT_I8(0xffff);
    /* low halves compared as non-negative int32 */
    __m256i c = _mm256_sub_epi32(_mm256_srli_epi32(e, 16),
                                 _mm256_cmpgt_epi32(_mm256_and_si256(a, low), _mm256_and_si256(e, low)));
    if (w == 0) c = _mm256_add_epi32(LT_I8(K->nneg), _mm256_sub_epi32(_mm256_xor_si256(c, negm), negm));
    return _mm256_andnot_si256(_mm256_cmpgt_epi32(mag, LT_I8(0x7f800000)), c);
}

/* Codes of x[0..31] * inv into out[0..31]. */
static inline void v8_encode32(int w, const float *x, float inv, uint8_t *out) {
    const __m256 s = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int k = 0; k < 4; k++) c[k] = v8_encode(w, _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), s));
    /* the packs work within 128-bit lanes: dword 2 * k + lane holds values 8 * k + 4 * lane + 0..3 */
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(b, order));
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

/* One 8-bit block at s; sm, sv: scratch for its moments. */
static inline __attribute__((always_inline)) void block8_t(const lt_args *a, int64_t s, int64_t len, float *sm,
                                                           float *sv, int g16, int p16, int cp) {
    const lt_args local = *a; /* a copy the stores cannot alias: scalars and pointers stay in registers */
    a = &local;
    const int64_t blk = s / a->block, nfull = len & ~(int64_t)31;
    const float am = a->mabs[blk], av = a->vabs[blk];
    __m256 xam = _mm256_setzero_ps(), xav = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nfull; i += 32) { /* 4 independent updates: their divider chains overlap */
        __m256 m[4], v[4];
        for (int k = 0; k < 4; k++) {
            m[k] = v8_decode(0, a->mq + s + i + 8 * k, am);
            v[k] = v8_decode(1, a->vq + s + i + 8 * k, av);
        }
        for (int k = 0; k < 4; k++) {
            v8_update(a, s + i + 8 * k, &m[k], &v[k], g16, p16, cp);
            _mm256_storeu_ps(sm + i + 8 * k, m[k]);
            _mm256_storeu_ps(sv + i + 8 * k, v[k]);
            xam = _mm256_max_ps(_mm256_andnot_ps(sign, m[k]), xam); /* = x > am ? x : am lane-wise: skips NaN */
            xav = _mm256_max_ps(v[k], xav);
        }
    }
    float lm[8], lv[8], nm = 0.0f, nv = 0.0f;
    _mm256_storeu_ps(lm, xam);
    _mm256_storeu_ps(lv, xav);
    for (int k = 0; k < 8; k++) {
        nm = lm[k] > nm ? lm[k] : nm;
        nv = lv[k] > nv ? lv[k] : nv;
    }
    for (int64_t i = nfull; i < len; i++) {
        sm[i] = g_code[0][a->mq[s + i]] * am;
        sv[i] = g_code[1][a->vq[s + i]] * av;
    }
    update_range(a, s + nfull, len - nfull, sm + nfull, sv + nfull);
    for (int64_t i = nfull; i < len; i++) {
        const float x = fabsf(sm[i]);
        nm = x > nm ? x : nm;
        nv = sv[i] > nv ? sv[i] : nv;
    }
    a->mabs[blk] = nm;
    a->vabs[blk] = nv;
    const float im = nm > 0.0f ? 1.0f / nm : 0.0f, iv = nv > 0.0f ? 1.0f / nv : 0.0f;
    for (int64_t i = 0; i < nfull; i += 32) {
        v8_encode32(0, sm + i, im, a->mq + s + i);
        v8_encode32(1, sv + i, iv, a->vq + s + i);
    }
    for (int64_t i = nfull; i < len; i++) {
        a->mq[s + i] = encode(0, sm[i] * im);
        a->vq[s + i] = encode(1, sv[i] * iv);
    }
}

/* The bucket encoder of the tests' lt_encode: codes of x[0..n), 32 at a time; returns how many it wrote. */
static int64_t vec_encode(int w, const float *x, uint8_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) w ? v8_encode32(1, x + i, 1.0f, out + i) : v8_encode32(0, x + i, 1.0f, out + i);
    return i;
}
#endif
