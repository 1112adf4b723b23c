// Paged decode attention: shared device code for the kernel bodies in paged_attention.metal.
//
// One threadgroup handles one (sequence, kv head[, partition]). Its NSG simdgroups take the
// context's tokens round-robin; within a simdgroup the 32 lanes split head_dim, so a K or V row
// is one coalesced read (each lane loads its DPL dims as vectors). Each row is read once and
// used for all G query heads sharing the kv head (grouped-query attention), unless G heads
// would overflow a lane's registers: then HS groups of simdgroups take GH heads each
// (pa_head_splits), each group reading the rows once. Softmax and
// accumulators are fp32 and online (running max), in base 2: queries are pre-scaled by
// scale * log2(e), so every exponential is one fast::exp2.

#include <metal_stdlib>
using namespace metal;

// -FLT_MAX: a finite "minus infinity", so exp2(m_old - m_new) never computes inf - inf.
#define PA_FINITE_MIN (-3.4028234663852886e38f)
#define PA_LOG2E 1.4426950408889634f
// Tokens whose block ids are staged in threadgroup memory at a time (double-buffered).
#define PA_CHUNK_TOKENS 256
// Tokens a simdgroup scores before one shared softmax rescale.
#define PA_TOKEN_GROUP 4
// `x` in every lane of the simdgroup, loaded by lane 0 only: an input every thread needs (a
// context length, the scale) costs one load per simdgroup, not one per thread.
#define PA_UNIFORM(x, lane) simd_broadcast((lane) == 0 ? (x) : 0, (ushort)0)

// Block-table entries staged per chunk: whole blocks, at least one.
#define PA_CHUNK_BLOCKS(BS) ((BS) >= PA_CHUNK_TOKENS ? 1 : PA_CHUNK_TOKENS / (BS))

// Register bound: live 32-bit values per lane of pa_attend, for GH query heads per simdgroup of
// DPL dims each (state m, l, acc; queries; U scores per head; a K and a V row; U row offsets).
// Apple GPUs spill beyond about 128.
#define PA_REGISTER_BUDGET 128
constexpr int pa_lane_registers(int gh, int dpl) {
  return gh * (2 * dpl + PA_TOKEN_GROUP + 2) + 2 * dpl + 2 * PA_TOKEN_GROUP;
}
// Groups of simdgroups (1, 2, 4 or 8) the G query heads are split over, so that a lane stays
// within the register bound: each group takes GH = ceil(G / HS) heads (the last may have
// padding heads, zero queries, never written) with NSG / HS simdgroups over the tokens; each
// K/V row is then read once per group (MLX's sdpa_vector_2pass_1 splits heads so too).
constexpr int pa_head_splits(int g, int dpl) {
  return pa_lane_registers(g, dpl) <= PA_REGISTER_BUDGET           ? 1
         : pa_lane_registers((g + 1) / 2, dpl) <= PA_REGISTER_BUDGET ? 2
         : pa_lane_registers((g + 3) / 4, dpl) <= PA_REGISTER_BUDGET ? 4
                                                                     : 8;
}
constexpr int pa_heads_per_simdgroup(int g, int dpl) {
  return (g + pa_head_splits(g, dpl) - 1) / pa_head_splits(g, dpl);
}
// Floats of the threadgroup array holding first the scaled queries [G, HD], then (after the
// token loop; every query read is behind a later barrier) the head outputs [2, NSG, HD].
#define PA_QO_FLOATS(G, HD, NSG) ((G) > 2 * (NSG) ? (G) * (HD) : 2 * (NSG) * (HD))

// Per-simdgroup online-softmax state; each lane owns DPL = head_dim / 32 output dims.
template <int G, int DPL>
struct PAState {
  float m[G];         // running max of the scores (log2 domain)
  float l[G];         // running sum of exp2(score - m)
  float acc[G][DPL];  // running sum of exp2(score - m) * v
};

// This lane's DPL consecutive elements at `p`, as floats, in loads of up to 4 elements (the
// widest Metal vector): one 8- or 16-byte load instead of DPL scalar loads.
template <typename T, int DPL>
inline void pa_load(const device T* p, thread float* out) {
  if (DPL % 4 == 0) {
    for (int i = 0; i < DPL; i += 4) {
      const vec<T, 4> x = *(const device vec<T, 4>*)(p + i);
      for (int j = 0; j < 4; j++) {
        out[i + j] = static_cast<float>(x[j]);
      }
    }
  } else if (DPL == 2) {
    const vec<T, 2> x = *(const device vec<T, 2>*)p;
    out[0] = static_cast<float>(x[0]);
    out[1] = static_cast<float>(x[1]);
  } else {
    for (int i = 0; i < DPL; i++) {
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

// This lane's DPL = HD / 32 values of the K/V row at element offset `off` (row * HD + lane * DPL)
// of a float pool.
template <typename T, int HD>
inline void pa_row(const device T* cache, size_t off, uint lane, thread float* out) {
  pa_load<T, HD / 32>(cache + off, out);
}

// The same from a quantized pool, dequantized in registers (fp32). The lane's DPL codes are one
// load of DPL * BITS bits (the simdgroup reads the row's codes in one coalesced sweep); its
// group's scale and bias come from lane `group` (lanes < HD / GS load one pair each, so every
// byte of the row is read once) by one shuffle. Lanes keep HD / 32 dims, as for a float pool:
// more dims per lane would widen the loads but multiply the query and accumulator registers.
template <typename T, int HD, int BITS, int GS>
inline void pa_row(PAQuantPool<T, HD, BITS, GS> pool, size_t off, uint lane, thread float* out) {
  constexpr int DPL = HD / 32;
  constexpr int NG = HD / GS;
  constexpr int LANE_BITS = DPL * BITS;
  static_assert((DPL & (DPL - 1)) == 0 && LANE_BITS >= 8 && LANE_BITS <= 64 && HD % GS == 0,
                "a lane's codes are whole bytes of one group");
  const size_t row = off / HD;
  float2 sb = float2(0.0f, 0.0f);
  if (lane < NG) {
    sb = float2(static_cast<float>(pool.scales[row * NG + lane]),
                static_cast<float>(pool.biases[row * NG + lane]));
  }
  sb = simd_shuffle(sb, (ushort)(lane * DPL / GS));
  const device uchar* p =
      (const device uchar*)(pool.data + row * (HD * BITS / 32)) + lane * (LANE_BITS / 8);
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
  for (int i = 0; i < DPL; i++) {
    const uint code = ((i * BITS < 32 ? w0 : w1) >> ((i * BITS) % 32)) & ((1u << BITS) - 1u);
    out[i] = sb.x * static_cast<float>(code) + sb.y;
  }
}

// Smallest power of two >= n, for 1 <= n <= 32.
constexpr int pa_pow2_at_least(int n) {
  return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : n <= 16 ? 16 : 32;
}

// N simdgroup sums at once: x[j] (this lane's partial of value j) becomes the simdgroup's total
// of value j, in every lane. With P = N rounded up to a power of two (values past N are zeros),
// the first log2(P) butterfly steps each halve the values a lane carries (it keeps the half its
// lane bit selects and sends the other to its partner), the remaining 5 - log2(P) steps add one
// value, and lane j * 32 / P then holds total j, broadcast to all: P - 1 + 5 - log2(P) shuffles
// and N broadcasts, against N simd_sums of 5 shuffle-and-add steps each. In place, in x.
template <int N>
inline void pa_simd_sums(thread float* x,  // [N]
                         uint lane) {
  static_assert(N >= 1 && N <= 32, "one butterfly carries at most 32 values");
  constexpr int P = pa_pow2_at_least(N);
  for (int level = 0; level < 5; level++) {
    const ushort o = (ushort)(16 >> level);
    const int half = (P >> level) / 2;  // values kept after this step (0: one value left)
    if (half == 0) {
      x[0] += simd_shuffle_xor(x[0], o);
      continue;
    }
    const bool up = (lane & o) != 0;  // this lane keeps values [half, 2 half) of those it carries
    for (int j = 0; j < half; j++) {
      const float lo = x[j];
      const float hi = j + half < N ? x[j + half] : 0.0f;
      x[j] = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, o);
    }
  }
  const float mine = x[0];  // total number lane * P / 32 (every 32 / P lanes hold the same one)
  for (int j = 0; j < N; j++) {
    x[j] = simd_shuffle(mine, (ushort)(j * (32 / P)));
  }
}

// Attend to tokens [tok_begin, tok_end) of one sequence for the G query heads of kv head `kvh`,
// leaving each simdgroup's partial state for its GH heads in `st` (simdgroup sg takes head group
// sg % HS, heads (sg % HS) * GH + j, and every (NSG / HS)-th token from sg / HS). Every thread
// of the threadgroup must call it.
// Table is `const device int32_t*`, or `const constant int32_t*` when MLX passes a table of
// fewer than 8 entries in the constant address space. tok_end <= max_blocks * BS (the caller
// clamps), so no table entry past the sequence's row is read.
template <typename T, int HD, int BS, int G, int NSG, typename KV, typename Table>
inline void pa_attend(
    thread PAState<pa_heads_per_simdgroup(G, HD / 32), HD / 32>& st,
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
    uint sg,                              // simdgroup index in the threadgroup
    uint lane,                            // thread index in the simdgroup
    uint tid,                             // thread index in the threadgroup
    threadgroup float* tg_q,              // [G, HD] scaled queries
    threadgroup int* tg_blocks) {         // [2, PA_CHUNK_BLOCKS(BS)] physical block ids
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int DPL = HD / 32;
  constexpr int NT = NSG * 32;
  constexpr int CB = PA_CHUNK_BLOCKS(BS);
  constexpr int CT = CB * BS;
  constexpr int U = PA_TOKEN_GROUP;
  constexpr int HS = pa_head_splits(G, DPL);
  constexpr int GH = pa_heads_per_simdgroup(G, DPL);
  constexpr int NTS = NSG / HS;  // simdgroups per head group, taking tokens round-robin
  const int g0 = (int)(sg % HS) * GH;  // this simdgroup's first head
  const int ts = (int)(sg / HS);       // and its place among its group's NTS simdgroups

  // Stage the G query heads once per threadgroup, pre-scaled into the log2 domain.
  const device T* qg = q + ((size_t)seq * num_kv_heads + kvh) * G * HD;
  const float qscale = scale * PA_LOG2E;
  for (int i = tid; i < G * HD; i += NT) {
    tg_q[i] = qscale * static_cast<float>(qg[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float qr[GH][DPL];
  for (int g = 0; g < GH; g++) {
    st.m[g] = PA_FINITE_MIN;
    st.l[g] = 0.0f;
    for (int i = 0; i < DPL; i++) {
      qr[g][i] = g0 + g < G ? tg_q[(g0 + g) * HD + lane * DPL + i] : 0.0f;
      st.acc[g][i] = 0.0f;
    }
  }

  const Table table = block_tables + (size_t)seq * max_blocks;
  const size_t block_stride = (size_t)num_kv_heads * BS * HD;  // elements per physical block
  const size_t head_offset = (size_t)kvh * BS * HD + lane * DPL;

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
    // U tokens per step (t0, t0 + NTS, ...): scores first, then one rescale for all of them.
    for (int t0 = c0 + ts; t0 < c1; t0 += U * NTS) {
      const int nu = min(U, (c1 - t0 + NTS - 1) / NTS);  // same for every lane of the simdgroup
      float s[U][GH];  // this lane's parts of the scores, then (pa_simd_sums) the scores
      size_t rows[U];  // element offset of each token's K/V row (this lane's dims)
      for (int u = 0; u < U; u++) {
        for (int g = 0; g < GH; g++) {
          s[u][g] = 0.0f;
        }
        if (u >= nu) {
          continue;  // past the chunk's end: zero scores, never used
        }
        const int t = t0 + u * NTS;
        rows[u] = (size_t)ids[t / BS - b0] * block_stride + head_offset + (size_t)(t % BS) * HD;
        float k[DPL];
        pa_row<T, HD>(k_cache, rows[u], lane, k);
        for (int g = 0; g < GH; g++) {
          for (int i = 0; i < DPL; i++) {
            s[u][g] += qr[g][i] * k[i];
          }
        }
      }
      // All U x GH scores summed over the lanes at once, in (at most two) chunks of <= 32.
      constexpr int NV = U * GH;
      static_assert(NV <= 64, "the register bound keeps U * GH <= 64");
      pa_simd_sums<(NV < 32 ? NV : 32)>(&s[0][0], lane);
      if (NV > 32) {
        pa_simd_sums<(NV > 32 ? NV - 32 : 1)>(&s[0][0] + 32, lane);
      }
      for (int g = 0; g < GH; g++) {
        float m_new = st.m[g];
        for (int u = 0; u < nu; u++) {
          m_new = max(m_new, s[u][g]);
        }
        if (m_new > st.m[g]) {  // uniform in the simdgroup: scores come from simd_sum
          const float corr = fast::exp2(st.m[g] - m_new);  // rescales what the old max summed
          st.l[g] *= corr;
          for (int i = 0; i < DPL; i++) {
            st.acc[g][i] *= corr;
          }
          st.m[g] = m_new;
        }
      }
      for (int u = 0; u < nu; u++) {
        float v[DPL];
        pa_row<T, HD>(v_cache, rows[u], lane, v);
        for (int g = 0; g < GH; g++) {
          const float p = fast::exp2(s[u][g] - st.m[g]);
          st.l[g] += p;
          for (int i = 0; i < DPL; i++) {
            st.acc[g][i] += p * v[i];
          }
        }
      }
    }
  }
}

// Publish each simdgroup's (max, sum) per head slot: tg_stats[sg * GH + j] and
// tg_stats[(NSG + sg) * GH + j]. Every thread of the threadgroup must call it.
template <int G, int DPL, int NSG>
inline void pa_publish_stats(
    thread PAState<pa_heads_per_simdgroup(G, DPL), DPL>& st,
    threadgroup float* tg_stats,  // [2, NSG, GH]: maxes then sums
    uint sg,
    uint lane) {
  constexpr int GH = pa_heads_per_simdgroup(G, DPL);
  if (lane == 0) {
    for (int j = 0; j < GH; j++) {
      tg_stats[sg * GH + j] = st.m[j];
      tg_stats[(NSG + sg) * GH + j] = st.l[j];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Threadgroup max of slot j of head group hg (head hg * GH + j) over the group's simdgroups
// hg, hg + HS, ...
template <int G, int DPL, int NSG>
inline float pa_slot_max(const threadgroup float* tg_stats,  // [2, NSG, GH]: maxes then sums
                         int hg, int j) {
  constexpr int HS = pa_head_splits(G, DPL);
  constexpr int GH = pa_heads_per_simdgroup(G, DPL);
  float M = PA_FINITE_MIN;
  for (int s = hg; s < NSG; s += HS) {
    M = max(M, tg_stats[s * GH + j]);
  }
  return M;
}

// That max M and the slot's sum L rescaled to it.
template <int G, int DPL, int NSG>
inline void pa_slot_stats(const threadgroup float* tg_stats,  // [2, NSG, GH]: maxes then sums
                          int hg, int j, thread float& M, thread float& L) {
  constexpr int HS = pa_head_splits(G, DPL);
  constexpr int GH = pa_heads_per_simdgroup(G, DPL);
  M = pa_slot_max<G, DPL, NSG>(tg_stats, hg, j);
  L = 0.0f;
  for (int s = hg; s < NSG; s += HS) {
    L += tg_stats[(NSG + s) * GH + j] * fast::exp2(tg_stats[s * GH + j] - M);
  }
}

// Stage slot j's accumulators, rescaled to their group's max, in half j % 2 of tg_o; returns
// that half. Every thread must call it, for j = 0, 1, ...: one barrier per slot suffices (the
// next slot's writes go to the other half, whose readers all passed this slot's barrier).
// Then pa_slot_output gives output dim d of head group hg's slot j.
template <int HD, int G, int NSG>
inline const threadgroup float* pa_stage_slot(
    thread PAState<pa_heads_per_simdgroup(G, HD / 32), HD / 32>& st,
    int j,
    const threadgroup float* tg_stats,  // [2, NSG, GH]: maxes then sums
    threadgroup float* tg_o,            // [2, NSG, HD]
    uint sg,
    uint lane) {
  constexpr int DPL = HD / 32;
  constexpr int HS = pa_head_splits(G, DPL);
  threadgroup float* half_o = tg_o + (j % 2) * NSG * HD;
  const float f = fast::exp2(st.m[j] - pa_slot_max<G, DPL, NSG>(tg_stats, (int)(sg % HS), j));
  for (int i = 0; i < DPL; i++) {
    half_o[sg * HD + lane * DPL + i] = st.acc[j][i] * f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return half_o;
}

// Output dim d of head group hg's staged slot: the sum over the group's simdgroups.
template <int HD, int G, int NSG>
inline float pa_slot_output(const threadgroup float* half_o,  // [NSG, HD]
                            int hg, int d) {
  constexpr int HS = pa_head_splits(G, HD / 32);
  float o = 0.0f;
  for (int s = hg; s < NSG; s += HS) {
    o += half_o[s * HD + d];
  }
  return o;
}
