/* The fused 8-bit AVX-512 path of _adamw_kernel.c (included there after the per-block passes it matches). */

#if LT_PATH == LT_AVX512VBMI
/* The 8-bit path in one AVX-512 loop: per 64 elements, decode the moments of block b, update them and the
 * parameter (the same operations in the same order as LT_UPDATE_LOOP, so the same results), keep the new
 * moments in scratch and their absmax in registers, and re-encode 64 elements of block b - 1, whose absmax is
 * known by then. In one loop body the update's divider work overlaps the codec's shuffles and integer ops, and
 * decoded values never go through memory: 10-15% faster than the per-block passes (separate 64-element loops
 * for the two were slower than either). */
typedef struct {
    int64_t s, len; /* the block waiting to be re-encoded (len 0: none) */
    const float *m, *v;
    float im, iv;
} lt_pending;

static inline __m512i v_bf16_rne(__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_set1_epi32(0x7fc0));
}

static inline __m512i v_mix(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline __m512i v_bf16_stochastic(__m512i u, uint32_t key, int64_t i) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(uint32_t)i),
                                         _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i h = _mm512_xor_si512(_mm512_mullo_epi32(idx, _mm512_set1_epi32((int)0x9e3779b9u)),
                                       _mm512_set1_epi32((int)key));
    const __m512i r = _mm512_and_si512(v_mix(h), _mm512_set1_epi32(0xffff));
    const __mmask16 special = _mm512_cmpge_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, r), 16), special, v_bf16_rne(u));
}

static inline __m512 v_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 elements at i of the update; g16, p16, cp are constants after inlining. */
static inline __attribute__((always_inline)) void v_update16(const lt_args *a, int64_t i, __m512 *m, __m512 *v,
                                                             int g16, int p16, int cp) {
    const __m512 g = _mm512_mul_ps(g16 ? v_load_bf16((const uint16_t *)a->grad + i)
                                       : _mm512_loadu_ps((const float *)a->grad + i),
                                   _mm512_set1_ps(a->grad_scale));
    const __m512 mi = _mm512_fmadd_ps(_mm512_set1_ps(a->w1), _mm512_sub_ps(g, *m), *m);
    const __m512 vr = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(a->w2), g), g,
                                      _mm512_mul_ps(*v, _mm512_set1_ps(a->beta2)));
    /* max_ps(f, vr) = f > vr ? f : vr, LT_UPDATE_LOOP's floor (v_floor 0: vr, which is never negative) */
    const __m512 vi = _mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(mi, mi), _mm512_set1_ps(a->v_floor)), vr);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(a->bc2_sqrt)),
                                       _mm512_set1_ps(a->eps));
    const __m512 p = p16 ? v_load_bf16(a->p16 + i) : _mm512_loadu_ps(a->p32 + i);
    const __m512 pn = _mm512_add_ps(_mm512_mul_ps(p, _mm512_set1_ps(a->decay)),
                                    _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(a->neg_step), mi), denom));
    if (p16) {
        const __m256i b = _mm512_cvtepi32_epi16(v_bf16_stochastic(_mm512_castps_si512(pn), a->sr_key, i));
        _mm256_storeu_si256((__m256i *)(a->p16 + i), b);
        if (cp) _mm256_storeu_si256((__m256i *)(a->copy + i), b);
    } else {
        _mm512_storeu_ps(a->p32 + i, pn);
        if (cp)
            _mm256_storeu_si256((__m256i *)(a->copy + i), _mm512_cvtepi32_epi16(v_bf16_rne(_mm512_castps_si512(pn))));
    }
    *m = mi;
    *v = vi;
}

static inline __attribute__((always_inline)) void fused_blocks(const lt_args *a, int64_t b0, int64_t b1,
                                                               float *scratch, int g16, int p16, int cp) {
    const lt_args local = *a; /* a copy the stores cannot alias: scalars and pointers stay in registers */
    a = &local;
    const int64_t bs = a->block;
    lt_pending q = {0, 0, NULL, NULL, 0.0f, 0.0f};
    for (int64_t b = b0; b <= b1; b++) {
        float *sm = scratch + (b & 1) * 2 * bs, *sv = sm + bs;
        const int64_t s = b * bs, len = b == b1 ? 0 : (s + bs <= a->n ? bs : a->n - s);
        const int64_t nfull = len & ~(int64_t)63, qfull = q.len & ~(int64_t)63;
        const float am = len ? a->mabs[b] : 0.0f, av = len ? a->vabs[b] : 0.0f;
        __m512 xam = _mm512_setzero_ps(), xav = _mm512_setzero_ps();
        for (int64_t k = 0; k < nfull || k < qfull; k += 64) {
            if (k < nfull) {
                __m512 dm[4], dv[4];
                dec64(0, a->mq + s + k, am, dm);
                dec64(1, a->vq + s + k, av, dv);
                for (int j = 0; j < 4; j++) {
                    v_update16(a, s + k + 16 * j, &dm[j], &dv[j], g16, p16, cp);
                    _mm512_storeu_ps(sm + k + 16 * j, dm[j]);
                    _mm512_storeu_ps(sv + k + 16 * j, dv[j]);
                    xam = _mm512_max_ps(xam, _mm512_abs_ps(dm[j]));
                    xav = _mm512_max_ps(xav, dv[j]);
                }
            }
            if (k < qfull) {
                enc64(0, q.m + k, q.im, a->mq + q.s + k);
                enc64(1, q.v + k, q.iv, a->vq + q.s + k);
            }
        }
        for (int64_t i = qfull; i < q.len; i++) {
            a->mq[q.s + i] = encode(0, q.m[i] * q.im);
            a->vq[q.s + i] = encode(1, q.v[i] * q.iv);
        }
        if (!len) break;
        float nm = _mm512_reduce_max_ps(xam), nv = _mm512_reduce_max_ps(xav);
        if (nfull < len) { /* ragged tail: the generic code */
            float *m = sm + nfull, *v = sv + nfull;
            const int64_t tl = len - nfull;
            for (int64_t i = 0; i < tl; i++) {
                m[i] = g_code[0][a->mq[s + nfull + i]] * am;
                v[i] = g_code[1][a->vq[s + nfull + i]] * av;
            }
            update_range(a, s + nfull, tl, m, v);
            for (int64_t i = 0; i < tl; i++) {
                const float x = fabsf(m[i]);
                nm = x > nm ? x : nm;
                nv = v[i] > nv ? v[i] : nv;
            }
        }
        a->mabs[b] = nm;
        a->vabs[b] = nv;
        q = (lt_pending){s, len, sm, sv, nm > 0.0f ? 1.0f / nm : 0.0f, nv > 0.0f ? 1.0f / nv : 0.0f};
    }
}

/* Blocks [b0, b1) of an 8-bit tensor; scratch holds two blocks' m and v. */
static void do_blocks8(const lt_args *a, int64_t b0, int64_t b1, float *scratch) {
    const int g16 = a->grad_bf16 != 0, p16 = a->p16 != NULL, cp = a->copy != NULL;
    switch (g16 | p16 << 1 | cp << 2) {
    case 0: fused_blocks(a, b0, b1, scratch, 0, 0, 0); break;
    case 1: fused_blocks(a, b0, b1, scratch, 1, 0, 0); break;
    case 2: fused_blocks(a, b0, b1, scratch, 0, 1, 0); break;
    case 3: fused_blocks(a, b0, b1, scratch, 1, 1, 0); break;
    case 4: fused_blocks(a, b0, b1, scratch, 0, 0, 1); break;
    case 5: fused_blocks(a, b0, b1, scratch, 1, 0, 1); break;
    case 6: fused_blocks(a, b0, b1, scratch, 0, 1, 1); break;
    default: fused_blocks(a, b0, b1, scratch, 1, 1, 1); break;
    }
}
#endif
