// Varlen paged attention (prefill chunks): the new tokens of several sequences, packed along one
// axis, attend causally to their paged KV caches. Text before the first `// @kernel` line is
// the header passed to mx.fast.metal_kernel; each `// @kernel NAME` section is a body (MLX
// writes the signature from the inputs and outputs).
//
// One threadgroup takes a tile of TQ query tokens of one sequence and one kv head, with all G
// query heads of that kv head: TQ * G query rows. It walks the sequence's keys once, KC at a
// time: the chunk's K and V rows are staged in threadgroup memory (each read from device once
// per tile) and used by every row, so a K/V row is read ceil(q_len / TQ) times per kv head.
// Each row is held by SP consecutive lanes that split head_dim (dims part, part + SP, ...);
// a score is their partial dot products summed with simd_shuffle_xor. Softmax is fp32 and
// online (a running max per row, rescaled once per chunk).
//
// Kernel paged_attention_varlen_mma (same inputs and staging walk) computes QK^T and PV with
// 8x8 simdgroup_matrix multiply-accumulates in fp32 instead: each simdgroup owns 8 tokens of
// one query head (NSG = GH * TQ / 8), K and V are staged as float. The wrapper picks it by shape
// (head_dim <= 128; the heads split over HS threadgroups so that NSG <= 8, 256 threads); other
// shapes run the kernel above.
//
// Template parameters: T (q/cache/out dtype), HD (head_dim), BS (block size), G (query heads
// per kv head), TQ (query tokens per tile), KC (keys per chunk), NSG (simdgroups per
// threadgroup), HS (head groups: a threadgroup takes GH = ceil(G / HS) of the G query heads,
// threadgroup x position hg takes heads [hg * GH, hg * GH + GH), so that threads x registers
// fit one GPU core's register file), SP (lanes per query row, a power of two <= 32), RPT
// (query rows per lane group), HAS_WINDOW and HAS_SINKS (0 or 1: see below).
//
// Softmax runs in base 2: scores carry scale * log2(e), so every exponential is one
// fast::exp2 (MLX compiles custom kernels without fast math: a plain exp is the precise one).
// Context lengths are clamped to the block table's width (block_tables_shape[1] * BS, the
// real width: the wrapper pads tables with rows, never columns), so bad metadata never reads
// past a sequence's row.
//
// Sliding window and sinks (as the decode kernels): template flags HAS_WINDOW (names end `_w`:
// read the runtime int32 scalar `window`, one variant for every window size) and HAS_SINKS
// (`_sk`: read `sinks`). A row at position p sees keys max(0, p - window + 1) .. p; a tile's key
// walk starts at the first block its first query's window overlaps (its later queries' windows
// start no earlier), so a long prompt reads about window + TQ keys per tile, not p. A sink is
// one logit per query head joining the softmax denominator only, folded once at the end.
//
// Quantized KV cache: kernel paged_attention_varlen_quant is the same body after
// `PAV_QUANT_VIEWS`, with inputs k_data, k_scales, k_biases, v_data, v_scales, v_biases in place
// of k_cache, v_cache and template values BITS and GS (values per scale/bias group) besides.
// Staging then takes one code word per thread (a group's words on consecutive lanes, its scale
// and bias read once and shuffled), dequantized in fp32 registers and stored to tg_k/tg_v as T.

#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

// -FLT_MAX: a finite "minus infinity", so exp2(m_old - m_new) never computes inf - inf.
#define PAV_FINITE_MIN (-3.4028234663852886e38f)
#define PAV_LOG2E 1.4426950408889634f

// Block-table entries a chunk of KC tokens can touch when it starts anywhere in a block.
#define PAV_CHUNK_BLOCKS(KC, BS) (((KC) + (BS) - 2) / (BS) + 1)

// The window of a kernel without one (or with window 0): pos - key < it for every key.
#define PAV_ALL_KEYS 0x7fffffff

// Whether the query at position `pos` sees key `key`: causal (not after it) and within its
// window of `win` positions, its own included. Never overflows: 0 <= pos - key once key <= pos.
inline bool pav_visible(int key, int pos, int win) {
  return key <= pos && pos - key < win;
}

// Where a tile whose first query sits at `pos0` starts its key walk: the first block of that
// query's window (0 without one). Keys before it are visible to none of the tile's queries.
inline int pav_walk_begin(int pos0, int win, int bs) {
  return pos0 < win ? 0 : (pos0 - win + 1) / bs * bs;
}

// A row's softmax denominator with its sink (log2 domain, like the scores: l was summed under
// the max m, so the sink's share is 2^(sink * log2(e) - m)); no value goes with it.
inline float pav_sink_denominator(float l, float m, float sink) {
  return l + fast::exp2(PAV_LOG2E * sink - m);
}

// A quantized K or V pool (mlxpaged.kv_quant.QuantizedPool): each row of HD values is BITS-bit
// codes packed LSB-first into uint32 words, plus a scale and a bias per GS values,
// value = scale * code + bias (mx.quantize's layout along head_dim).
template <typename T, int HD, int BITS, int GS>
struct PAVQuantPool {
  const device uint32_t* data;  // [rows, HD * BITS / 32]
  const device T* scales;       // [rows, HD / GS]
  const device T* biases;       // [rows, HD / GS]
};

// A quantized kernel variant's body is the float body after this line: K and V are then these
// views of the (data, scales, biases) inputs instead of float pools.
#define PAV_QUANT_VIEWS                                                   \
  PAVQuantPool<T, HD, BITS, GS> k_cache = {k_data, k_scales, k_biases}; \
  PAVQuantPool<T, HD, BITS, GS> v_cache = {v_data, v_scales, v_biases};

// Elements one thread stages per step: one from a float pool, one 32-bit word of codes (32 / BITS
// values) from a quantized one, so that every thread of the threadgroup stages.
template <typename Pool>
struct PAVItems {
  static constexpr constant int value = 1;
};
template <typename T, int HD, int BITS, int GS>
struct PAVItems<PAVQuantPool<T, HD, BITS, GS>> {
  static constexpr constant int value = 32 / BITS;
};

// Stage pool element `src` (a float pool) into `dst` (T, or float for the MMA kernel); `ok`
// false: nothing. Every lane calls it (the quantized overload's shuffle needs them all).
template <typename T, typename D>
inline void pav_stage(const device T* cache, size_t src, bool ok, uint lane, threadgroup D* dst) {
  if (ok) {
    *dst = static_cast<D>(cache[src]);
  }
}

// Stage the 32 / BITS values of the code word holding element `src` (a multiple of 32 / BITS)
// of a quantized pool into dst[0, 32 / BITS): fp32 math, each value rounded once to T. A group's
// W = GS * BITS / 32 words go to W consecutive lanes (the caller's unit index is the thread
// index), whose first reads the group's scale and bias once and shuffles them to the others:
// every byte is read once and every thread stages. Every lane of the simdgroup must call it;
// `ok` is the same for a whole group (a chunk is whole rows).
template <typename T, int HD, int BITS, int GS, typename D>
inline void pav_stage(PAVQuantPool<T, HD, BITS, GS> pool, size_t src, bool ok, uint lane,
                      threadgroup D* dst) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int W = GS / PER_WORD;  // words per group
  static_assert(HD % GS == 0 && GS % PER_WORD == 0 && 32 % W == 0,
                "a group's words sit on consecutive lanes of one simdgroup");
  const size_t row = src / HD;
  const int g = (src % HD) / GS;
  float2 sb = float2(0.0f, 0.0f);
  if (ok && lane % W == 0) {
    sb = float2(static_cast<float>(pool.scales[row * (HD / GS) + g]),
                static_cast<float>(pool.biases[row * (HD / GS) + g]));
  }
  sb = simd_shuffle(sb, (ushort)(lane - lane % W));
  if (ok) {
    const uint x = pool.data[src / PER_WORD];  // rows are whole words: HD % PER_WORD == 0
    for (int k = 0; k < PER_WORD; k++) {
      const uint code = (x >> (k * BITS)) & ((1u << BITS) - 1u);
      // Rounded to T first, so a float destination holds the values a T one would.
      dst[k] = static_cast<D>(static_cast<T>(sb.x * static_cast<float>(code) + sb.y));
    }
  }
}

// @kernel paged_attention_varlen
// launch: grid (32 * NSG * HS, num_kv_heads, num_tiles), threadgroup (32 * NSG, 1, 1)
// inputs:  q            [T_total, num_kv_heads * G, HD] T   (new tokens, packed)
//          k_cache      [num_blocks, num_kv_heads, BS, HD] T
//          v_cache      [num_blocks, num_kv_heads, BS, HD] T
//          block_tables [num_seqs, max_blocks] int32
//          cu_seqlens_q [num_seqs + 1] int32       (sequence s owns q rows cu[s]:cu[s+1])
//          context_lens [num_seqs] int32            (cached plus new tokens)
//          tiles        [num_tiles, 2] int32        (sequence, first new token of the tile)
//          scale        [] float32
//          window       [] int32: sliding window (0: none), read when HAS_WINDOW
//          sinks        [>= num_kv_heads * G] float32: per-head sink logits, read when HAS_SINKS
// output:  out          [T_total, num_kv_heads * G, HD] T (rows of tiled sequences only)
constexpr int DPT = HD / SP;        // dims per lane
constexpr int NT = 32 * NSG;        // threads per threadgroup
constexpr int NRG = NT / SP;        // lane groups (one query row each per slot)
constexpr int GH = (G + HS - 1) / HS;  // query heads per threadgroup
constexpr int ROWS = TQ * GH;       // query rows of a tile
constexpr int CB = PAV_CHUNK_BLOCKS(KC, BS);
constexpr int EPI = PAVItems<decltype(k_cache)>::value;  // elements staged per thread and step
static_assert(HD % SP == 0 && 32 % SP == 0, "a row's lanes split head_dim inside one simdgroup");
static_assert(NRG * RPT >= ROWS, "every query row of the tile has a lane group");

const int hg = threadgroup_position_in_grid.x;  // head group
const int kvh = threadgroup_position_in_grid.y;
const int tile = threadgroup_position_in_grid.z;
const int num_kv_heads = threadgroups_per_grid.y;
const int max_blocks = block_tables_shape[1];
const uint tid = thread_index_in_threadgroup;
const int part = tid % SP;  // this lane's share of head_dim
const int rg = tid / SP;    // this lane's group

const int seq = tiles[2 * tile];
const int i0 = tiles[2 * tile + 1];
const int q_begin = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_begin;
const int first_pos = context_lens[seq] - q_len;  // position of new token 0
const int n_tok = min(TQ, q_len - i0);
// The tile's last token sees keys [0, kv_end), within the table's width.
const int kv_end = min(first_pos + i0 + n_tok, max_blocks * BS);
const int heads = num_kv_heads * G;
const float qscale = scale * PAV_LOG2E;  // scores in the log2 domain
const int win = HAS_WINDOW && window > 0 ? window : PAV_ALL_KEYS;  // no window: never read

threadgroup T tg_k[KC * HD];
threadgroup T tg_v[KC * HD];
threadgroup int tg_blocks[CB];

// Row r = token i * GH + head g of the group; rows past the tile's tokens or G see nothing (pos -1).
float qr[RPT][DPT];
float acc[RPT][DPT];
float m[RPT];
float l[RPT];
int pos[RPT];
size_t row_off[RPT];  // element offset of the row in q and out
for (int j = 0; j < RPT; j++) {
  const int r = j * NRG + rg;
  const int i = r / GH;
  const int g = hg * GH + r % GH;
  const bool valid = r < ROWS && i < n_tok && g < G;
  pos[j] = valid ? first_pos + i0 + i : -1;
  row_off[j] = valid ? ((size_t)(q_begin + i0 + i) * heads + kvh * G + g) * HD : 0;
  m[j] = PAV_FINITE_MIN;
  l[j] = 0.0f;
  for (int x = 0; x < DPT; x++) {
    qr[j][x] = valid ? qscale * static_cast<float>(q[row_off[j] + x * SP + part]) : 0.0f;
    acc[j][x] = 0.0f;
  }
}

const size_t block_stride = (size_t)num_kv_heads * BS * HD;  // elements per physical block
const size_t head_off = (size_t)kvh * BS * HD;
// A window skips the blocks before the first query's window: later queries' start no earlier.
for (int c0 = HAS_WINDOW ? pav_walk_begin(first_pos + i0, win, BS) : 0; c0 < kv_end; c0 += KC) {
  const int nk = min(KC, kv_end - c0);  // keys in this chunk
  const int b0 = c0 / BS;
  const int nb = (c0 + nk - 1) / BS - b0 + 1;
  // Stage the chunk's block ids, then its K and V rows: each read once per threadgroup.
  for (int b = tid; b < nb; b += NT) {
    tg_blocks[b] = block_tables[(size_t)seq * max_blocks + b0 + b];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // barrier 1: tg_blocks written
  // A uniform loop: every lane reaches the quantized staging's shuffle.
  for (int e0 = 0; e0 < nk * HD; e0 += NT * EPI) {
    const bool ok = e0 + (int)tid * EPI < nk * HD;
    const int e = ok ? e0 + (int)tid * EPI : 0;
    const int t = c0 + e / HD;
    const size_t src = (size_t)tg_blocks[t / BS - b0] * block_stride + head_off +
        (size_t)(t % BS) * HD + e % HD;
    pav_stage(k_cache, src, ok, tid % 32, tg_k + e);
    pav_stage(v_cache, src, ok, tid % 32, tg_v + e);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // barrier 2: tg_k, tg_v written

  for (int j = 0; j < RPT; j++) {
    // s is indexed by compile-time loops only (k < KC, guarded by the uniform k < nk), so it
    // stays in registers: a runtime-bounded index would put it in memory.
    float s[KC];
    float mc = m[j];
    for (int k = 0; k < KC; k++) {
      if (k < nk) {
        float d = 0.0f;
        for (int x = 0; x < DPT; x++) {
          d += qr[j][x] * static_cast<float>(tg_k[k * HD + x * SP + part]);
        }
        for (ushort o = SP / 2; o > 0; o >>= 1) {
          d += simd_shuffle_xor(d, o);  // sum over the row's SP lanes
        }
        // Causal and windowed: key c0 + k is visible iff not after the row's token nor before
        // its window (rows of one tile start their windows at different keys).
        s[k] = pav_visible(c0 + k, pos[j], win) ? d : PAV_FINITE_MIN;
        mc = max(mc, s[k]);
      }
    }
    const float corr = fast::exp2(m[j] - mc);  // rescales what was summed under the old max
    l[j] *= corr;
    for (int x = 0; x < DPT; x++) {
      acc[j][x] *= corr;
    }
    for (int k = 0; k < KC; k++) {
      if (k < nk) {
        const float p = pav_visible(c0 + k, pos[j], win) ? fast::exp2(s[k] - mc) : 0.0f;
        l[j] += p;
        for (int x = 0; x < DPT; x++) {
          acc[j][x] += p * static_cast<float>(tg_v[k * HD + x * SP + part]);
        }
      }
    }
    m[j] = mc;
  }
  // No barrier here: the next chunk writes tg_blocks only after barrier 2 of this one (its last
  // reader) and tg_k/tg_v only after barrier 1 of the next, which every reader must reach first.
}

for (int j = 0; j < RPT; j++) {
  if (pos[j] >= 0) {
    // The row's head is hg * GH + r % GH (r = j * NRG + rg, as above); its sink joins l only.
    const float den =
        HAS_SINKS ? pav_sink_denominator(l[j], m[j], sinks[kvh * G + hg * GH + (j * NRG + rg) % GH]) : l[j];
    for (int x = 0; x < DPT; x++) {
      // l 0 (a row past the table's width, bad metadata): 0, not 0 / 0.
      out[row_off[j] + x * SP + part] = static_cast<T>(l[j] > 0.0f ? acc[j][x] / den : 0.0f);
    }
  }
}

// @kernel paged_attention_varlen_mma
// launch: grid (32 * NSG * HS, num_kv_heads, num_tiles), threadgroup (32 * NSG, 1, 1); inputs
// and output as paged_attention_varlen. Template values T, HD, BS, G, TQ, KC, HS, NSG
// (= GH * TQ / 8, GH = ceil(G / HS) query heads per threadgroup), HAS_WINDOW, HAS_SINKS.
//
// Simdgroup sg takes query head g = hg * GH + sg / (TQ / 8) of the kv head and tokens (sg % (TQ / 8)) * 8
// + [0, 8) of the tile: an 8-row strip. Per chunk of KC keys, in 8x8 fp32 fragments:
// S = Q K^T (HD / 8 multiply-accumulates per 8 keys), scaled and causally masked per element,
// then O = O * corr + P V. Lane l holds row fm, columns fn and fn + 1 of every fragment (MLX's
// BaseMMAFrag::get_coord, steel/gemm/mma.h), so a row's 8 columns sit on 4 lanes (l ^ 1, l ^ 8):
// the row max takes 2 shuffles per chunk, the row sum 2 in all (each lane keeps its share).
constexpr int NT = 32 * NSG;        // threads per threadgroup
constexpr int HB = HD / 8;          // 8-dim blocks of a row
constexpr int KB = KC / 8;          // 8-key blocks of a chunk
constexpr int CB = PAV_CHUNK_BLOCKS(KC, BS);
constexpr int EPI = PAVItems<decltype(k_cache)>::value;  // elements staged per thread and step
constexpr int GH = (G + HS - 1) / HS;  // query heads per threadgroup
// Row stride of the staged K and V tiles: HD + 4 floats, so the 8 rows a simdgroup_load reads
// start in different banks (MLX's steel attention pads its tiles by 16 bytes so).
constexpr int LD = HD + 4;
static_assert(HD % 8 == 0 && KC % 8 == 0 && TQ % 8 == 0, "whole 8x8 fragments");
static_assert(NSG == GH * (TQ / 8), "one simdgroup per 8 tokens of one query head");

const int hg = threadgroup_position_in_grid.x;  // head group
const int kvh = threadgroup_position_in_grid.y;
const int tile = threadgroup_position_in_grid.z;
const int num_kv_heads = threadgroups_per_grid.y;
const int max_blocks = block_tables_shape[1];
const uint tid = thread_index_in_threadgroup;
const int sg = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;
const int fm = ((lane / 4) & 4) + (lane / 2) % 4;      // this lane's fragment row
const int fn = ((lane / 4) & 2) * 2 + (lane % 2) * 2;  // and its first column

const int seq = tiles[2 * tile];
const int i0 = tiles[2 * tile + 1];
const int q_begin = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_begin;
const int first_pos = context_lens[seq] - q_len;  // position of new token 0
const int n_tok = min(TQ, q_len - i0);
// The tile's last token sees keys [0, kv_end), within the table's width.
const int kv_end = min(first_pos + i0 + n_tok, max_blocks * BS);
const int heads = num_kv_heads * G;
const float sc = scale * PAV_LOG2E;  // read once (each read of the constant buffer is a load); log2 domain
const int win = HAS_WINDOW && window > 0 ? window : PAV_ALL_KEYS;  // no window: never read

threadgroup float tg_k[KC * LD];  // [KC, LD]: rows of HD floats, padded
threadgroup float tg_v[KC * LD];
threadgroup int tg_blocks[CB];

// This lane's row: token i of the tile, query head g; tokens past the tile see nothing (pos -1).
const int g = hg * GH + sg / (TQ / 8);
const int i = (sg % (TQ / 8)) * 8 + fm;
const bool valid = i < n_tok && g < G;
const int pos = valid ? first_pos + i0 + i : -1;
const size_t row_off = valid ? ((size_t)(q_begin + i0 + i) * heads + kvh * G + g) * HD : 0;

simdgroup_float8x8 qf[HB];  // the strip's queries, unscaled (the scale applies to scores)
simdgroup_float8x8 of[HB];  // its output accumulator
for (int d = 0; d < HB; d++) {
  for (int e = 0; e < 2; e++) {
    qf[d].thread_elements()[e] = valid ? static_cast<float>(q[row_off + d * 8 + fn + e]) : 0.0f;
  }
  of[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
float m = PAV_FINITE_MIN;  // the row's running max (the same on its 4 lanes)
float l = 0.0f;            // this lane's share of the row's running sum

const size_t block_stride = (size_t)num_kv_heads * BS * HD;  // elements per physical block
const size_t head_off = (size_t)kvh * BS * HD;
// A window skips the blocks before the first query's window: later queries' start no earlier.
for (int c0 = HAS_WINDOW ? pav_walk_begin(first_pos + i0, win, BS) : 0; c0 < kv_end; c0 += KC) {
  const int nk = min(KC, kv_end - c0);  // keys in this chunk
  const int nkb = (nk + 7) / 8;         // 8-key blocks holding them
  const int b0 = c0 / BS;
  const int nb = (c0 + nk - 1) / BS - b0 + 1;
  // Stage the chunk's block ids, then its K and V rows: each read once per threadgroup.
  for (int b = tid; b < nb; b += NT) {
    tg_blocks[b] = block_tables[(size_t)seq * max_blocks + b0 + b];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // barrier 1: tg_blocks written
  // A uniform loop: every lane reaches the quantized staging's shuffle.
  for (int e0 = 0; e0 < nk * HD; e0 += NT * EPI) {
    const bool ok = e0 + (int)tid * EPI < nk * HD;
    const int e = ok ? e0 + (int)tid * EPI : 0;
    const int t = c0 + e / HD;
    const size_t src = (size_t)tg_blocks[t / BS - b0] * block_stride + head_off +
        (size_t)(t % BS) * HD + e % HD;
    pav_stage(k_cache, src, ok, (uint)lane, tg_k + (e / HD) * LD + e % HD);
    pav_stage(v_cache, src, ok, (uint)lane, tg_v + (e / HD) * LD + e % HD);
  }
  // The last block's rows past the chunk: zeros, not stale values or NaN, since 0 * NaN in P V
  // would poison the accumulator (their scores are masked).
  for (int e = nk * HD + tid; e < nkb * 8 * HD; e += NT) {
    tg_k[(e / HD) * LD + e % HD] = 0.0f;
    tg_v[(e / HD) * LD + e % HD] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // barrier 2: tg_k, tg_v written

  // sf is indexed by compile-time loops only (kb < KB, guarded by the uniform kb < nkb), so it
  // stays in registers.
  simdgroup_float8x8 sf[KB];  // scores, then probabilities, of the chunk's key blocks
  float mc = m;
  for (int kb = 0; kb < KB; kb++) {
    if (kb < nkb) {
      sf[kb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < HB; d++) {
        simdgroup_float8x8 kt;  // K^T block [8 dims, 8 keys]: the pointer carries the offset
        simdgroup_load(kt, tg_k + kb * 8 * LD + d * 8, LD, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(sf[kb], qf[d], kt, sf[kb]);
      }
      for (int e = 0; e < 2; e++) {
        // Causal and windowed: key c0 + kb * 8 + fn + e is visible iff not after the row's
        // token nor before its window.
        const int key = c0 + kb * 8 + fn + e;
        const float s = pav_visible(key, pos, win) ? sc * sf[kb].thread_elements()[e] : PAV_FINITE_MIN;
        sf[kb].thread_elements()[e] = s;
        mc = max(mc, s);
      }
    }
  }
  mc = max(mc, simd_shuffle_xor(mc, 1));  // over the row's 4 lanes
  mc = max(mc, simd_shuffle_xor(mc, 8));
  const float corr = fast::exp2(m - mc);  // rescales what was summed under the old max
  l *= corr;
  for (int d = 0; d < HB; d++) {
    of[d].thread_elements() *= corr;
  }
  for (int kb = 0; kb < KB; kb++) {
    if (kb < nkb) {
      for (int e = 0; e < 2; e++) {
        const int key = c0 + kb * 8 + fn + e;
        const float p = pav_visible(key, pos, win) ? fast::exp2(sf[kb].thread_elements()[e] - mc) : 0.0f;
        sf[kb].thread_elements()[e] = p;
        l += p;
      }
      for (int d = 0; d < HB; d++) {
        simdgroup_float8x8 vf;  // V block [8 keys, 8 dims]
        simdgroup_load(vf, tg_v + kb * 8 * LD + d * 8, LD);
        simdgroup_multiply_accumulate(of[d], sf[kb], vf, of[d]);
      }
    }
  }
  m = mc;
  // No barrier here: as in paged_attention_varlen, the next chunk writes tg_blocks after this
  // chunk's barrier 2 and tg_k/tg_v after its own barrier 1, which every reader reaches first.
}

l += simd_shuffle_xor(l, 1);  // the row's sum over its 4 lanes
l += simd_shuffle_xor(l, 8);
if (pos >= 0) {  // a token before position 0 (context shorter than q_len: bad metadata) sees no key
  // The sink joins the denominator only; l 0 (a row past the table's width): 0, not 0 / 0.
  const float den = HAS_SINKS ? pav_sink_denominator(l, m, sinks[kvh * G + g]) : l;
  for (int d = 0; d < HB; d++) {
    for (int e = 0; e < 2; e++) {
      out[row_off + d * 8 + fn + e] = static_cast<T>(l > 0.0f ? of[d].thread_elements()[e] / den : 0.0f);
    }
  }
}
