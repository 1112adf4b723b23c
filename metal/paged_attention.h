// Paged decode attention: shared device code for the kernel bodies in paged_attention.metal.
//
// One threadgroup handles one (sequence, kv head[, partition]). Its NSG simdgroups take the
// context's tokens round-robin, S tokens per simdgroup step: the 32 lanes form S sub-groups of
// L = pa_token_lanes(HD) lanes, each scoring one token, so a lane holds D = HD / L dims (8 for
// head_dim 32..256 powers of two: one 16-byte load of fp16 K and one of V per lane and token)
// and a step's S rows are one coalesced read. Each row is read once and used for all G query
// heads sharing the kv head (grouped-query attention), unless G heads would overflow a lane's
// registers: then HS groups of simdgroups take GH heads each (pa_head_splits), each group
// reading the rows once. A sub-group's G partial scores are summed over its L lanes by one
// butterfly and gathered back to all of them (pa_token_sums); each sub-group keeps its own
// online-softmax state, and the NSG * S states are combined once, after the token loop.
// Softmax and accumulators are fp32, in base 2: queries (kept in threadgroup memory, so a lane
// holds only its heads' accumulators) are pre-scaled by scale * log2(e), so every exponential
// is one fast::exp2.

#include <metal_stdlib>
using namespace metal;

// -FLT_MAX: a finite "minus infinity", so exp2(m_old - m_new) never computes inf - inf.
#define PA_FINITE_MIN (-3.4028234663852886e38f)
#define PA_LOG2E 1.4426950408889634f
// Tokens whose block ids are staged in threadgroup memory at a time (double-buffered).
#define PA_CHUNK_TOKENS 256
// `x` in every lane of the simdgroup, loaded by lane 0 only: an input every thread needs (a
// context length, the scale) costs one load per simdgroup, not one per thread.
#define PA_UNIFORM(x, lane) simd_broadcast((lane) == 0 ? (x) : 0, (ushort)0)

// Block-table entries staged per chunk: whole blocks, at least one.
#define PA_CHUNK_BLOCKS(BS) ((BS) >= PA_CHUNK_TOKENS ? 1 : PA_CHUNK_TOKENS / (BS))

// Smallest power of two >= n, for 1 <= n <= 32.
constexpr int pa_pow2_at_least(int n) {
  return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : n <= 16 ? 16 : 32;
}
// Lanes that score one token: head_dim / 8 rounded up to a power of two (4 at head_dim 32, 8
// at 64, 16 at 128, 32 at 160..256), so a lane holds at most 8 dims and 32 / L tokens share a
// simdgroup step.
constexpr int pa_token_lanes(int hd) { return pa_pow2_at_least((hd + 7) / 8); }
// Dims per lane, D = HD / L (8 for power-of-two head_dims; 6 at 96 and 192, 5 at 160, 7 at 224).
constexpr int pa_lane_dims(int hd) { return hd / pa_token_lanes(hd); }
// Tokens per simdgroup step, one per sub-group of L lanes.
constexpr int pa_step_tokens(int hd) { return 32 / pa_token_lanes(hd); }

// Register bound: live 32-bit values per lane of pa_attend, for GH query heads per simdgroup of
// D dims per lane (state m, l, acc; one score per head; a K and a V row's D values).
// Apple GPUs spill beyond about 128.
#define PA_REGISTER_BUDGET 128
constexpr int pa_lane_registers(int gh, int d) {
  return gh * (d + 3) + 2 * d;
}
// Groups of simdgroups (1, 2, 4 or 8) the G query heads are split over, so that a lane stays
// within the register bound: each group takes GH = ceil(G / HS) heads (the last may have
// padding heads, zero scores, never written) with NSG / HS simdgroups over the tokens; each
// K/V row is then read once per group (MLX's sdpa_vector_2pass_1 splits heads so too).
// `d` is the dims per lane, pa_lane_dims(HD).
constexpr int pa_head_splits(int g, int d) {
  return pa_lane_registers(g, d) <= PA_REGISTER_BUDGET           ? 1
         : pa_lane_registers((g + 1) / 2, d) <= PA_REGISTER_BUDGET ? 2
         : pa_lane_registers((g + 3) / 4, d) <= PA_REGISTER_BUDGET ? 4
                                                                   : 8;
}
constexpr int pa_heads_per_simdgroup(int g, int d) {
  return (g + pa_head_splits(g, d) - 1) / pa_head_splits(g, d);
}
// Online-softmax states of a threadgroup: one per sub-group (NSG * S of them).
#define PA_STATES(HD, NSG) ((NSG) * pa_step_tokens(HD))
// Floats of the threadgroup array holding first the scaled queries [G, HD], then (after the
// token loop; every query read is behind a later barrier) the states' outputs [2, STATES, HD].
#define PA_QO_FLOATS(G, HD, NSG)                                   \
  ((G) > 2 * PA_STATES(HD, NSG) ? (G) * (HD) : 2 * PA_STATES(HD, NSG) * (HD))

// A sub-group's online-softmax state; each lane owns D = pa_lane_dims(HD) output dims.
template <int G, int D>
struct PAState {
  float m[G];       // running max of the scores (log2 domain)
  float l[G];       // running sum of exp2(score - m)
  float acc[G][D];  // running sum of exp2(score - m) * v
};

// Eight 2-byte values (half, bfloat) at `p` as floats: one 16-byte load.
template <typename T, int SIZE = sizeof(T)>
struct PAWide {
  static inline void load8(const device T* p, thread float* out) {
    const uint4 x = *(const device uint4*)p;
    const vec<T, 4> lo = as_type<vec<T, 4>>(x.xy);
    const vec<T, 4> hi = as_type<vec<T, 4>>(x.zw);
    for (int j = 0; j < 4; j++) {
      out[j] = static_cast<float>(lo[j]);
      out[4 + j] = static_cast<float>(hi[j]);
    }
  }
};
// Eight floats: two 16-byte loads.
template <typename T>
struct PAWide<T, 4> {
  static inline void load8(const device T* p, thread float* out) {
    for (int i = 0; i < 8; i += 4) {
      const vec<T, 4> x = *(const device vec<T, 4>*)(p + i);
      for (int j = 0; j < 4; j++) {
        out[i + j] = static_cast<float>(x[j]);
      }
    }
  }
};

// This lane's D consecutive elements at `p`, as floats: 8 at a time in 16-byte loads (fp16,
// bf16; two for fp32), else in vectors of 4 or 2, else one by one.
template <typename T, int D>
inline void pa_load(const device T* p, thread float* out) {
  if (D % 8 == 0) {
    for (int i = 0; i < D; i += 8) {
      PAWide<T>::load8(p + i, out + i);
    }
  } else if (D % 4 == 0) {
    for (int i = 0; i < D; i += 4) {
      const vec<T, 4> x = *(const device vec<T, 4>*)(p + i);
      for (int j = 0; j < 4; j++) {
        out[i + j] = static_cast<float>(x[j]);
      }
    }
  } else if (D % 2 == 0) {
    for (int i = 0; i < D; i += 2) {
      const vec<T, 2> x = *(const device vec<T, 2>*)(p + i);
      out[i] = static_cast<float>(x[0]);
      out[i + 1] = static_cast<float>(x[1]);
    }
  } else {
    for (int i = 0; i < D; i++) {
      out[i] = static_cast<float>(p[i]);
    }
  }
}

// A quantized K or V pool (mlxpaged.kv_quant.QuantizedPool) as the kernels see it: each row of
// HD values is BITS-bit codes packed LSB-first into uint32 words, plus one scale and one bias
// per GS values, value = scale * code + bias (mx.quantize's layout along head_dim).
template <typename T, int HD, int BITS, int GS>
struct PAQuantPool {
  const device uint32_t* data;  // [rows, HD * BITS / 32]
  const device T* scales;       // [rows, HD / GS]
  const device T* biases;       // [rows, HD / GS]
};

// A quantized kernel variant's body is the float body after this line: K and V are then these
// views of the (data, scales, biases) inputs instead of float pools.
#define PA_QUANT_VIEWS                                                   \
  const PAQuantPool<T, HD, BITS, GS> k_cache = {k_data, k_scales, k_biases}; \
  const PAQuantPool<T, HD, BITS, GS> v_cache = {v_data, v_scales, v_biases};

// This lane's D = pa_lane_dims(HD) values of the K/V row at element offset `off`
// (row * HD + (lane % L) * D) of a float pool; zeros when `valid` is false (no read).
template <typename T, int HD>
inline void pa_row(const device T* cache, size_t off, bool valid, uint lane, thread float* out) {
  constexpr int D = pa_lane_dims(HD);
  if (valid) {
    pa_load<T, D>(cache + off, out);
  } else {
    for (int i = 0; i < D; i++) {
      out[i] = 0.0f;
    }
  }
}

// The same from a quantized pool, dequantized in registers (fp32). The lane's D codes are one
// load of D * BITS bits (a sub-group reads its row's codes in one coalesced sweep); its group's
// scale and bias come from lane `group` of its sub-group (lanes < HD / GS load one pair each,
// so every byte of the row is read once) by one shuffle, which every lane must reach.
template <typename T, int HD, int BITS, int GS>
inline void pa_row(PAQuantPool<T, HD, BITS, GS> pool, size_t off, bool valid, uint lane,
                   thread float* out) {
  constexpr int L = pa_token_lanes(HD);
  constexpr int D = HD / L;
  constexpr int NG = HD / GS;
  constexpr int LANE_BITS = D * BITS;
  static_assert((D & (D - 1)) == 0 && LANE_BITS >= 8 && LANE_BITS <= 64 && HD % GS == 0 &&
                    GS % D == 0 && NG <= L,
                "a lane's codes are whole bytes of one group");
  const uint sl = lane % L;  // place in the sub-group
  const uint base = lane - sl;
  const size_t row = off / HD;
  float2 sb = float2(0.0f, 0.0f);
  if (valid && sl < NG) {
    sb = float2(static_cast<float>(pool.scales[row * NG + sl]),
                static_cast<float>(pool.biases[row * NG + sl]));
  }
  sb = simd_shuffle(sb, (ushort)(base + sl * D / GS));
  if (!valid) {
    for (int i = 0; i < D; i++) {
      out[i] = 0.0f;
    }
    return;
  }
  const device uchar* p =
      (const device uchar*)(pool.data + row * (HD * BITS / 32)) + sl * (LANE_BITS / 8);
  uint w0 = 0u;  // codes 0 .. 32 / BITS - 1
  uint w1 = 0u;  // the rest (64-bit lanes only)
  if (LANE_BITS == 8) {
    w0 = *p;
  } else if (LANE_BITS == 16) {
    w0 = *(const device ushort*)p;
  } else if (LANE_BITS == 32) {
    w0 = *(const device uint*)p;
  } else {
    const uint2 x = *(const device uint2*)p;
    w0 = x.x;
    w1 = x.y;
  }
  for (int i = 0; i < D; i++) {
    const uint code = ((i * BITS < 32 ? w0 : w1) >> ((i * BITS) % 32)) & ((1u << BITS) - 1u);
    out[i] = sb.x * static_cast<float>(code) + sb.y;
  }
}

// The dot product of a query's D dims (threadgroup memory, pre-scaled) with this lane's K dims.
template <int D>
inline float pa_dot(const threadgroup float* q, const thread float* k) {
  float s = 0.0f;
  if (D % 4 == 0) {
    for (int i = 0; i < D; i += 4) {
      const float4 x = *(const threadgroup float4*)(q + i);
      s += x[0] * k[i] + x[1] * k[i + 1] + x[2] * k[i + 2] + x[3] * k[i + 3];
    }
  } else {
    for (int i = 0; i < D; i++) {
      s += q[i] * k[i];
    }
  }
  return s;
}

// N sums over each sub-group of L lanes (all 32 / L sub-groups at once): x[j] (this lane's
// partial of value j) becomes its sub-group's total of value j, in every lane of the sub-group.
// With P = N rounded up to a power of two (values past N are zeros), the first log2(min(P, L))
// butterfly steps each halve the values a lane carries (it keeps the half its lane bit selects
// and sends the other to its partner), any remaining steps add one value; then each lane holds
// C = max(1, P / L) totals (total j in register j % C of lane j / C, or of lane j * L / P when
// P <= L) and N shuffles gather every total to every lane: P - P / L (+ log2(L / P) when
// P < L) + N shuffles, against N simd_sums of 5 shuffle-and-add steps each. In place, in x.
template <int N, int L>
inline void pa_token_sums(thread float* x,  // [N]
                          uint lane) {
  static_assert(N >= 1 && N <= 32, "one butterfly carries at most 32 values");
  static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "sub-groups of 1, 2, ..., 32 lanes");
  constexpr int P = pa_pow2_at_least(N);
  constexpr int C = P > L ? P / L : 1;
  int n = P;  // values this lane carries (the same in every lane: the loop is uniform)
  for (int step = L / 2; step > 0; step /= 2) {
    const ushort o = (ushort)step;
    if (n == 1) {
      x[0] += simd_shuffle_xor(x[0], o);
      continue;
    }
    const int mid = n / 2;
    const bool up = (lane & o) != 0;  // this lane keeps values [mid, 2 mid) of those it carries
    for (int j = 0; j < mid; j++) {
      const float lo = x[j];
      const float hi = j + mid < N ? x[j + mid] : 0.0f;
      x[j] = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, o);
    }
    n = mid;
  }
  // Gather, highest value first: x[j] is written after every read of registers >= j.
  const uint base = lane - lane % L;
  for (int j = N - 1; j >= 0; j--) {
    x[j] = simd_shuffle(x[j % C], (ushort)(base + (P <= L ? j * (L / P) : j / C)));
  }
}

// Attend to tokens [max(tok_begin, tok_lo), tok_end) of one sequence for the G query heads of kv head `kvh`,
// leaving each sub-group's partial state for its GH heads in `st` (simdgroup sg takes head
// group sg % HS, heads (sg % HS) * GH + j; among its group's NTS = NSG / HS simdgroups it is
// number sg / HS and takes the steps of S tokens starting at tok_begin + (sg / HS) * S, then
// every S * NTS tokens; its sub-group b takes token b of each step). Every thread of the
// threadgroup must call it.
// Table is `const device int32_t*`, or `const constant int32_t*` when MLX passes a table of
// fewer than 8 entries in the constant address space. tok_end <= max_blocks * BS (the caller
// clamps), so no table entry past the sequence's row is read.
template <typename T, int HD, int BS, int G, int NSG, typename KV, typename Table>
inline void pa_attend(
    thread PAState<pa_heads_per_simdgroup(G, pa_lane_dims(HD)), pa_lane_dims(HD)>& st,
    const device T* q,                    // [num_seqs, num_kv_heads * G, HD]
    KV k_cache,                           // [num_blocks, num_kv_heads, BS, HD]: const device T*
    KV v_cache,                           // or PAQuantPool (same rows, quantized)
    Table block_tables,                   // [num_seqs, max_blocks] int32
    int max_blocks,
    int num_kv_heads,
    float scale,
    int seq,
    int kvh,
    int tok_begin,                        // a multiple of BS
    int tok_end,
    int tok_lo,                           // first position attended (a sliding window's start)
    uint sg,                              // simdgroup index in the threadgroup
    uint lane,                            // thread index in the simdgroup
    uint tid,                             // thread index in the threadgroup
    threadgroup float* tg_q,              // [G, HD] scaled queries
    threadgroup int* tg_blocks) {         // [2, PA_CHUNK_BLOCKS(BS)] physical block ids
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int L = pa_token_lanes(HD);
  constexpr int D = HD / L;
  constexpr int S = 32 / L;
  constexpr int NT = NSG * 32;
  constexpr int CB = PA_CHUNK_BLOCKS(BS);
  constexpr int CT = CB * BS;
  constexpr int HS = pa_head_splits(G, D);
  constexpr int GH = pa_heads_per_simdgroup(G, D);
  constexpr int NTS = NSG / HS;  // simdgroups per head group, taking steps round-robin
  const int g0 = (int)(sg % HS) * GH;  // this simdgroup's first head
  const int ts = (int)(sg / HS);       // and its place among its group's NTS simdgroups
  const int sub = (int)(lane / L);     // this lane's token in a step
  const uint sl = lane % L;            // and its dims of that token's row: [sl * D, sl * D + D)

  // Stage the G query heads once per threadgroup, pre-scaled into the log2 domain. They are
  // read only in the token loop, behind the first chunk's barrier: no barrier of their own.
  const device T* qg = q + ((size_t)seq * num_kv_heads + kvh) * G * HD;
  const float qscale = scale * PA_LOG2E;
  for (int i = tid; i < G * HD; i += NT) {
    tg_q[i] = qscale * static_cast<float>(qg[i]);
  }

  for (int g = 0; g < GH; g++) {
    st.m[g] = PA_FINITE_MIN;
    st.l[g] = 0.0f;
    for (int i = 0; i < D; i++) {
      st.acc[g][i] = 0.0f;
    }
  }

  const Table table = block_tables + (size_t)seq * max_blocks;
  const size_t block_stride = (size_t)num_kv_heads * BS * HD;  // elements per physical block
  const size_t head_offset = (size_t)kvh * BS * HD + sl * D;
  const threadgroup float* qd = tg_q + sl * D;  // this lane's dims of each query head

  int buf = 0;
  for (int c0 = tok_begin; c0 < tok_end; c0 += CT, buf ^= 1) {
    // Stage this chunk's block ids (each table entry read once per threadgroup) into the buffer
    // not read during the previous chunk: one barrier per chunk. Its readers two chunks ago
    // all passed the previous chunk's barrier before anyone refills it here.
    threadgroup int* ids = tg_blocks + buf * CB;
    const int b0 = c0 / BS;
    for (int i = tid; i < CB; i += NT) {
      ids[i] = (b0 + i) * BS < tok_end ? table[b0 + i] : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int c1 = min(c0 + CT, tok_end);
    // S tokens per step (t0, ..., t0 + S - 1), one per sub-group; the step loop is uniform in
    // the simdgroup (every lane reaches the shuffles), a sub-group past c1 scores zeros.
    for (int t0 = c0 + ts * S; t0 < c1; t0 += S * NTS) {
      const int t = t0 + sub;
      const bool valid = t < c1 && t >= tok_lo;  // the window's start need not be a block's
      const size_t row =
          valid ? (size_t)ids[t / BS - b0] * block_stride + head_offset + (size_t)(t % BS) * HD
                : 0;
      float k[D];
      float v[D];
      pa_row<T, HD>(k_cache, row, valid, lane, k);
      pa_row<T, HD>(v_cache, row, valid, lane, v);  // issued early: in flight during the sums
      float s[GH];  // this lane's parts of its token's scores, then (pa_token_sums) the scores
      for (int g = 0; g < GH; g++) {
        s[g] = g0 + g < G ? pa_dot<D>(qd + (g0 + g) * HD, k) : 0.0f;
      }
      pa_token_sums<GH, L>(s, lane);
      if (valid) {
        for (int g = 0; g < GH; g++) {
          // One exp2 per (token, head): 2^-|s - m| is the old sum's rescale when s is a new
          // max, else the token's weight.
          const float d = s[g] - st.m[g];
          const float e = fast::exp2(-fabs(d));
          float p = e;
          if (d > 0.0f) {
            const float corr = e;
            st.l[g] *= corr;
            for (int i = 0; i < D; i++) {
              st.acc[g][i] *= corr;
            }
            st.m[g] = s[g];
            p = 1.0f;
          }
          st.l[g] += p;
          for (int i = 0; i < D; i++) {
            st.acc[g][i] += p * v[i];
          }
        }
      }
    }
  }
}

// Publish each sub-group's (max, sum) per head slot: state w = sg * S + sub (S sub-groups per
// simdgroup) writes tg_stats[w * GH + j] and tg_stats[(STATES + w) * GH + j]. Every thread of
// the threadgroup must call it.
template <int G, int HD, int NSG>
inline void pa_publish_stats(
    thread PAState<pa_heads_per_simdgroup(G, pa_lane_dims(HD)), pa_lane_dims(HD)>& st,
    threadgroup float* tg_stats,  // [2, STATES, GH]: maxes then sums
    uint sg,
    uint lane) {
  constexpr int L = pa_token_lanes(HD);
  constexpr int GH = pa_heads_per_simdgroup(G, pa_lane_dims(HD));
  constexpr int NW = PA_STATES(HD, NSG);
  if (lane % L == 0) {
    const uint w = sg * (32 / L) + lane / L;
    for (int j = 0; j < GH; j++) {
      tg_stats[w * GH + j] = st.m[j];
      tg_stats[(NW + w) * GH + j] = st.l[j];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Threadgroup max of slot j of head group hg (head hg * GH + j) over the group's states: those
// of simdgroups hg, hg + HS, ...
template <int G, int HD, int NSG>
inline float pa_slot_max(const threadgroup float* tg_stats,  // [2, STATES, GH]: maxes then sums
                         int hg, int j) {
  constexpr int S = pa_step_tokens(HD);
  constexpr int HS = pa_head_splits(G, pa_lane_dims(HD));
  constexpr int GH = pa_heads_per_simdgroup(G, pa_lane_dims(HD));
  float M = PA_FINITE_MIN;
  for (int s = hg; s < NSG; s += HS) {
    for (int b = 0; b < S; b++) {
      M = max(M, tg_stats[(s * S + b) * GH + j]);
    }
  }
  return M;
}

// That max M and the slot's sum L rescaled to it.
template <int G, int HD, int NSG>
inline void pa_slot_stats(const threadgroup float* tg_stats,  // [2, STATES, GH]: maxes then sums
                          int hg, int j, thread float& M, thread float& L) {
  constexpr int S = pa_step_tokens(HD);
  constexpr int NW = PA_STATES(HD, NSG);
  constexpr int HS = pa_head_splits(G, pa_lane_dims(HD));
  constexpr int GH = pa_heads_per_simdgroup(G, pa_lane_dims(HD));
  M = pa_slot_max<G, HD, NSG>(tg_stats, hg, j);
  L = 0.0f;
  for (int s = hg; s < NSG; s += HS) {
    for (int b = 0; b < S; b++) {
      const int w = s * S + b;
      L += tg_stats[(NW + w) * GH + j] * fast::exp2(tg_stats[w * GH + j] - M);
    }
  }
}

// Stage slot j's accumulators, rescaled to their group's max, in half j % 2 of tg_o; returns
// that half. Every thread must call it, for j = 0, 1, ...: one barrier per slot suffices (the
// next slot's writes go to the other half, whose readers all passed this slot's barrier).
// Then pa_slot_output gives output dim d of head group hg's slot j.
template <int HD, int G, int NSG>
inline const threadgroup float* pa_stage_slot(
    thread PAState<pa_heads_per_simdgroup(G, pa_lane_dims(HD)), pa_lane_dims(HD)>& st,
    int j,
    const threadgroup float* tg_stats,  // [2, STATES, GH]: maxes then sums
    threadgroup float* tg_o,            // [2, STATES, HD]
    uint sg,
    uint lane) {
  constexpr int L = pa_token_lanes(HD);
  constexpr int D = HD / L;
  constexpr int HS = pa_head_splits(G, D);
  constexpr int NW = PA_STATES(HD, NSG);
  threadgroup float* half_o = tg_o + (j % 2) * NW * HD;
  const uint w = sg * (32 / L) + lane / L;
  const float f = fast::exp2(st.m[j] - pa_slot_max<G, HD, NSG>(tg_stats, (int)(sg % HS), j));
  for (int i = 0; i < D; i++) {
    half_o[w * HD + (lane % L) * D + i] = st.acc[j][i] * f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return half_o;
}

// Output dim d of head group hg's staged slot: the sum over the group's states.
template <int HD, int G, int NSG>
inline float pa_slot_output(const threadgroup float* half_o,  // [STATES, HD]
                            int hg, int d) {
  constexpr int S = pa_step_tokens(HD);
  constexpr int HS = pa_head_splits(G, pa_lane_dims(HD));
  float o = 0.0f;
  for (int s = hg; s < NSG; s += HS) {
    for (int b = 0; b < S; b++) {
      o += half_o[(s * S + b) * HD + d];
    }
  }
  return o;
}
