// runtime.cpp: the execution engine linked into every emulated kernel's shared library.
//
// One launch runs the grid's threadgroups one after another on the calling OS thread. Each GPU
// thread of a threadgroup is a fiber with its own stack; a fiber runs until it finishes or
// reaches a barrier or a SIMD-group function, then control returns to the scheduler here.
// Invariants:
//  * Within a round the scheduler resumes every runnable fiber once, in the launch's lane order
//    (forward, reverse or seeded random), so code that lacks a barrier sees other threads'
//    writes early or late depending on the order.
//  * A SIMD-group function resolves once every live (not finished) lane of its SIMD group waits
//    at the same call site; a barrier releases once every live thread waits at the same site.
//    Anything else with no runnable fiber left is divergence or deadlock: an error.
//  * Buffers are registered address ranges; the compiler's load/store tracing calls
//    __sanitizer_cov_load*/store* on every access, which counts bytes per buffer exactly and
//    turns an access outside a buffer (into its guard zone) into a named error. Guard pages
//    (PROT_NONE) after each buffer catch untraced accesses through SIGSEGV.
//  * Accesses to threadgroup memory by different simdgroups with no barrier between them, at
//    least one a write, are reported as data races (tg_access).
//  * Errors never unwind through kernel code: the fiber switches back to the scheduler (or the
//    signal handler siglongjmps to the launch), and the launch returns a message.
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdarg.h>
#include <signal.h>
#include <ucontext.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT extern "C" __attribute__((visibility("default")))
#define HIDDEN extern "C" __attribute__((visibility("hidden")))

enum { N_ATTRS = 40 };
enum { ST_RUNNABLE, ST_SIMD, ST_BARRIER, ST_DONE };
enum { K_SIMD_BARRIER = 100 };
// Indices into LaunchDesc::stats (kernel.py reads them). Counts are per lane for exp/exp2 and
// loads, per simdgroup for SIMD-group functions, per threadgroup for barriers.
enum {
  STAT_THREADS = 0, STAT_TGS, STAT_BARRIERS, STAT_SIMD_OPS, STAT_EXITED_BARRIERS, STAT_TG_BYTES,
  STAT_REG_BYTES, STAT_EXP, STAT_EXP2, STAT_SHUFFLES, STAT_REDUCTIONS, STAT_NOFENCE_BARRIERS,
  STAT_LOAD1, STAT_LOAD2, STAT_LOAD4, STAT_LOAD8, STAT_LOAD16,
  STAT_MMA, STAT_MLOAD, STAT_MSTORE,  // simdgroup_matrix calls, per simdgroup
  STAT_SCALAR_REG_BYTES,  // the part of STAT_REG_BYTES from scalar and vector sites (lower.py: site >= 512)
};
// SIMD sync kinds of the simdgroup_matrix functions (metal_simdgroup_matrix.h).
enum { K_MLOAD = 6, K_MSTORE = 7, K_MMA = 8 };
enum { MEM_THREADGROUP = 2 };  // mem_flags::mem_threadgroup
enum { N_REG_SITES = 1024 };
static uint64_t g_reg_site[N_REG_SITES];  // bytes of each thread-private array declaration

struct Buffer {              // shared with kernel.py (ctypes): keep the layout in sync
  const char* name;
  char* lo;                  // data start
  char* hi;                  // data end
  char* map_lo;              // whole mapping, guard pages included
  char* map_hi;
  uint64_t bytes_read;
  uint64_t bytes_written;
  int64_t is_output;
  unsigned char* written_map;  // outputs: one bit per byte, set by every store
  uint64_t bytes_unwritten;    // out: bytes of the buffer no store touched
};

struct LaunchDesc {          // shared with kernel.py (ctypes): keep the layout in sync
  int32_t grid[3];
  int32_t tg[3];
  int32_t order;             // 0 forward, 1 reverse, 2 random
  int32_t strict_barriers;   // 1: a barrier with finished threads is an error
  int32_t race_check;        // 1: threadgroup-memory races between simdgroups are errors
  int32_t reserved;
  uint64_t seed;
  int64_t timeout_s;         // > 0: abandon the launch after this many seconds (SIGALRM)
  int64_t stack_size;
  void* entry;               // void entry(void* const* bufs, const uint32_t* attrs)
  void* const* args;         // kernel arguments, one per parameter
  Buffer* buffers;
  int64_t n_buffers;
  uint64_t stats[24];        // out: see STAT_* (kernel.py's LaunchStats reads them by index)
  void* pool;                // Pool shared by every kernel library of the process (or null)
};

// Memory every launch needs but no launch keeps: the fiber stacks (one mapping, a guard page
// leading each stack: two memory mappings per stack, ~520 for 256 threads) and the threadgroup
// arena with its race shadow. Every kernel library links its own copy of this runtime, so
// kernel.py passes one zeroed Pool per process (LaunchDesc::pool) and all libraries reuse it:
// the process holds one set of stacks however many kernels it compiles (vm.max_map_count is
// 65530). Launches are serialised (kernel.py's lock), so sharing is safe; a launch refills the
// arena and shadow it uses before each threadgroup. The layout is private to this file, and
// libraries whose runtime differs never meet in one process (the library cache key hashes the
// runtime), but `magic` checks it anyway.
struct Pool {
  uint64_t magic;
  char* stacks;              // n_stacks * stack_len bytes, each stack led by a guard page
  uint64_t n_stacks;
  uint64_t stack_len;        // guard page included
  char* arena;               // TG_CAP bytes, then a guard page
  void* shadow;              // TG_CAP Shadow records
};
static_assert(sizeof(Pool) <= 64, "kernel.py reserves 64 bytes for the pool");
enum : uint64_t { POOL_MAGIC = 0x6d6c78656d75706cull + sizeof(Pool) };

struct Fiber {
  void* sp;
  int state;
  int kind;
  int size;
  int done_order;
  const char* file;          // call site of the barrier / SIMD function it waits in
  int line, col;
  uint32_t attrs[N_ATTRS];
  alignas(16) unsigned char slot[64];
  char* stack_lo;            // its stack in the pool (guard page first)
  size_t stack_len;
};

struct SimdGroup {
  uint32_t mask;
  alignas(16) unsigned char snap[32 * 64];
};

HIDDEN void mlxemu_swap(void** save_sp, void* to_sp);
HIDDEN void mlxemu_fiber_start();

// x86-64 System V context switch: save callee-saved registers on the current stack, switch
// stacks, restore the other side's registers and return into it.
__asm__(
    ".text\n"
    ".globl mlxemu_swap\n.hidden mlxemu_swap\n.type mlxemu_swap,@function\n"
    "mlxemu_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".globl mlxemu_fiber_start\n.hidden mlxemu_fiber_start\n.type mlxemu_fiber_start,@function\n"
    "mlxemu_fiber_start:\n"
    "  movq %r12, %rdi\n  call mlxemu_fiber_main\n  ud2\n");

// ---------------------------------------------------------------------------------------------
// Launch state (one launch at a time in the process: libraries share the Pool, and the Python
// side holds one lock for all of them).
static LaunchDesc* g_desc;
static Fiber g_fibers[1024];   // at most 1024 threads per threadgroup (untouched bss is free)
static Pool g_own_pool;         // used when the caller passes no pool
static Pool* g_pool;            // the current launch's pool
static int g_n;                 // threads in the current threadgroup
static Fiber* g_cur;
static void* g_sched_sp;
static SimdGroup g_sg[32];      // at most 1024 threads per threadgroup
static char g_err[1024];
static int g_has_err;
static sigjmp_buf g_jmp;
static uintptr_t g_lo, g_span;  // hull of all buffer mappings: the fast path of the tracing
static int g_done_count;

extern "C" char __start_mlxemu_tg[] __attribute__((weak));
extern "C" char __stop_mlxemu_tg[] __attribute__((weak));

static void where(char* out, size_t n) {
  if (!g_cur) { out[0] = 0; return; }
  const uint32_t* a = g_cur->attrs;
  snprintf(out, n, " (thread_position_in_grid=(%u,%u,%u), threadgroup (%u,%u,%u), thread %u)",
           a[0], a[1], a[2], a[3], a[4], a[5], a[24]);
}

static void set_error(const char* fmt, ...) {
  if (g_has_err) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  if (k > 0 && (size_t)k < sizeof g_err) where(g_err + k, sizeof g_err - k);
  g_has_err = 1;
}

// From a fiber: stop it for good and go back to the scheduler.
[[noreturn]] static void fiber_abort() {
  g_cur->state = ST_DONE;
  void* dummy;
  mlxemu_swap(&dummy, g_sched_sp);
  __builtin_unreachable();
}

// ---------------------------------------------------------------------------------------------
// Access tracing (compiler callbacks). Only addresses inside a registered mapping matter.
static void __attribute__((noinline)) access_slow(const char* p, size_t n, int store) {
  for (int64_t i = 0; i < g_desc->n_buffers; ++i) {
    Buffer* b = &g_desc->buffers[i];
    if (p >= b->map_hi || p + n <= b->map_lo) continue;
    if (p >= b->lo && p + n <= b->hi) {
      if (store) {
        b->bytes_written += n;
        if (b->written_map)
          for (size_t k = (size_t)(p - b->lo), e = k + n; k < e; ++k) b->written_map[k >> 3] |= 1u << (k & 7);
      } else {
        b->bytes_read += n;
        g_desc->stats[n == 1 ? STAT_LOAD1 : n == 2 ? STAT_LOAD2 : n == 4 ? STAT_LOAD4 : n == 8 ? STAT_LOAD8 : STAT_LOAD16]++;
      }
      return;
    }
    set_error("out-of-bounds %s of buffer '%s': %zu bytes at byte offset %lld (buffer is %lld bytes)",
              store ? "write" : "read", b->name, n, (long long)(p - b->lo), (long long)(b->hi - b->lo));
    if (g_cur) fiber_abort();
    return;
  }
}
// Threadgroup-memory race check. Per byte: the last write and the reads since, stamped with
// the epoch (threadgroup barriers released so far in this threadgroup), the simdgroup's own
// epoch (SIMD-group functions and simdgroup barriers it has passed) and the thread. A race is
// two accesses to a byte, at least one a write, by different threads with nothing ordering
// them: different simdgroups in one epoch, or lanes of one simdgroup with no SIMD-level sync
// between (fibers do not run in lockstep, so such code would give order-dependent results).
// Writes by lanes of one simdgroup to one byte are not flagged (one store instruction on a
// GPU); atomics are exempt.
struct Shadow {
  uint32_t w_epoch, w_sepoch, r_epoch, r_sepoch;
  int16_t w_sg, r_sg;        // r_sg == -2: read by several simdgroups this epoch
  uint16_t w_tid, r_tid;     // r_tid == 0xFFFF: read by several lanes since the last sync
};
// Threadgroup arena: every `threadgroup` array the lowering turned into a slot lives here,
// at a fixed offset for the library's lifetime, with a red zone of TG_RED bytes after each
// and a guard page at the end. g_owner maps each byte to its array (0: red zone). The memory
// itself is the pool's, shared with other libraries: it is refilled before each threadgroup.
enum : size_t { TG_CAP = 64 * 1024, TG_RED = 64, TG_LIMIT = 32 * 1024 };
struct TgVar {
  int id;
  size_t size, off;
  const char* name;
};
static char* g_arena;
static TgVar g_vars[512];
static int g_nvars;
static size_t g_arena_used = TG_RED;  // next free offset: red zone first
static size_t g_tg_bytes;             // Metal's count: sizes rounded up to 16 bytes
static uint16_t g_owner[TG_CAP];
static Shadow* g_shadow;
static uint32_t g_epoch;
static uint32_t g_sepoch[32];
static int g_atomic_depth;

EXPORT void mlxemu_atomic(int enter) { g_atomic_depth += enter ? 1 : -1; }

static void tg_out_of_bounds(size_t off, size_t n, int store) {
  // Name the array whose end (or start) is nearest: the index ran past it.
  const TgVar* best = nullptr;
  long dist = 0;
  for (int i = 0; i < g_nvars; ++i) {
    const TgVar* v = &g_vars[i];
    long d = off >= v->off + v->size ? (long)(off - v->off - v->size) : (long)(v->off - off);
    if (!best || d < dist) { best = v; dist = d; }
  }
  if (best)
    set_error("out-of-bounds %s of threadgroup array '%s': %zu bytes at byte offset %ld "
              "(the array is %zu bytes)", store ? "write" : "read", best->name, n,
              (long)off - (long)best->off, best->size);
  else
    set_error("out-of-bounds %s of threadgroup memory", store ? "write" : "read");
  fiber_abort();
}

static void __attribute__((noinline)) tg_access(const char* p, size_t n, int store) {
  if (!g_cur) return;
  size_t off0 = (size_t)(p - g_arena);
  for (size_t k = 0; k < n; ++k)
    if (off0 + k >= TG_CAP || !g_owner[off0 + k]) tg_out_of_bounds(off0 + k, n, store);
  if (g_atomic_depth || !g_desc->race_check) return;
  int sg = (int)g_cur->attrs[25];
  uint16_t tid = (uint16_t)g_cur->attrs[24];
  uint32_t E = g_epoch, S = g_sepoch[sg];
  for (size_t k = 0; k < n; ++k) {
    size_t off = (size_t)(p + k - g_arena);
    if (off >= TG_CAP) break;
    Shadow* sh = &g_shadow[off];
    const char* what = nullptr;
    unsigned other = 0;
    int other_sg = sg;
    if (sh->w_epoch == E && (sh->w_sg != sg || (!store && sh->w_tid != tid && sh->w_sepoch == S))) {
      what = "wrote";
      other = sh->w_tid;
      other_sg = sh->w_sg;
    } else if (store && sh->r_epoch == E &&
               (sh->r_sg != sg || (sh->r_sepoch == S && sh->r_tid != tid))) {
      what = "read";
      other = sh->r_tid;
      other_sg = sh->r_sg;
    }
    if (what) {
      char who[64];
      if (other == 0xFFFF || other_sg == -2) snprintf(who, sizeof who, "other threads");
      else snprintf(who, sizeof who, "thread %u (simdgroup %d)", other, other_sg);
      const TgVar* v = &g_vars[g_owner[off] - 1];
      set_error("data race on threadgroup array '%s' (byte %zu of %zu): %s %s it and thread %u "
                "(simdgroup %d) %s it with no %s in between",
                v->name, off - v->off, v->size, who, what, (unsigned)tid, sg, store ? "wrote" : "read",
                other_sg == sg ? "simdgroup_barrier or SIMD-group function" : "threadgroup_barrier");
      fiber_abort();
    }
    if (store) {
      sh->w_epoch = E;
      sh->w_sepoch = S;
      sh->w_sg = (int16_t)sg;
      sh->w_tid = tid;
    } else if (sh->r_epoch != E || (sh->r_sg == sg && sh->r_sepoch != S)) {
      sh->r_epoch = E;
      sh->r_sepoch = S;
      sh->r_sg = (int16_t)sg;
      sh->r_tid = tid;
    } else if (sh->r_sg != sg) {
      sh->r_sg = -2;
    } else if (sh->r_tid != tid) {
      sh->r_tid = 0xFFFF;
    }
  }
}

// The arena is tested first: it may lie anywhere, between two buffer mappings included (the
// hull below is not a set of buffers), and an arena access must always reach the race and
// red-zone checks.
// A vector access (8 or 16 bytes: float2, half4, float4 ...) must be aligned to its size, as on
// a GPU; a `threadgroup float` array cast to `float4*` is not, unless declared so (the arena
// places arrays of smaller alignment off 16 bytes on purpose, see mlxemu_tg_slot).
static void __attribute__((noinline)) misaligned(const char* p, size_t n, int store) {
  if ((uintptr_t)p - (uintptr_t)g_arena < TG_CAP) {
    size_t off = (size_t)(p - g_arena);
    const TgVar* v = off < TG_CAP && g_owner[off] ? &g_vars[g_owner[off] - 1] : nullptr;
    set_error("misaligned %zu-byte %s of threadgroup array '%s' at byte offset %ld: declare the "
              "array with the vector type (or alignas(%zu))", n, store ? "write" : "read",
              v ? v->name : "?", v ? (long)(off - v->off) : (long)off, n);
  } else {
    set_error("misaligned %zu-byte %s of device memory at address %p", n, store ? "write" : "read", (const void*)p);
  }
  if (g_cur) fiber_abort();
}

static inline void access(const void* p, size_t n, int store) {
  if (!g_desc) return;
  const bool tg = (uintptr_t)p - (uintptr_t)g_arena < TG_CAP;
  if (!tg && (uintptr_t)p - g_lo >= g_span) return;
  if (n >= 8 && ((uintptr_t)p & (n - 1))) misaligned((const char*)p, n, store);
  if (tg) tg_access((const char*)p, n, store);
  else access_slow((const char*)p, n, store);
}

// Called by each thread when it reaches a `threadgroup` declaration (lower.py rewrites it to
// a reference to this slot): the same storage for the same declaration and size, always.
EXPORT void* mlxemu_tg_slot(int id, size_t size, size_t align, const char* name) {
  for (int i = 0; i < g_nvars; ++i)
    if (g_vars[i].id == id && g_vars[i].size == size) return g_arena + g_vars[i].off;
  // Arrays of alignment under 16 start at `align` past a 16-byte boundary, the least a GPU
  // promises them, so a vector cast that needs more faults here as it may on a Mac.
  size_t off = (g_arena_used + 15) / 16 * 16;
  if (align < 16) off += align;
  else off = (g_arena_used + align - 1) / align * align;
  size_t rounded = (size + 15) / 16 * 16;
  if (g_tg_bytes + rounded > TG_LIMIT || off + size + TG_RED > TG_CAP || g_nvars == 512) {
    set_error("threadgroup memory exceeds %zu bytes with '%s' (%zu bytes)", (size_t)TG_LIMIT, name, size);
    fiber_abort();
  }
  TgVar* v = &g_vars[g_nvars++];
  v->id = id;
  v->size = size;
  v->off = off;
  v->name = name;
  for (size_t k = off; k < off + size; ++k) g_owner[k] = (uint16_t)g_nvars;
  memset(g_arena + off, 0xFF, size);  // NaN / 0xFF.. until written
  memset(g_shadow + off, 0, size * sizeof(Shadow));
  g_arena_used = off + size + TG_RED;
  g_tg_bytes += rounded;
  return g_arena + off;
}
EXPORT void __sanitizer_cov_load1(void* p) { access(p, 1, 0); }
EXPORT void __sanitizer_cov_load2(void* p) { access(p, 2, 0); }
EXPORT void __sanitizer_cov_load4(void* p) { access(p, 4, 0); }
EXPORT void __sanitizer_cov_load8(void* p) { access(p, 8, 0); }
EXPORT void __sanitizer_cov_load16(void* p) { access(p, 16, 0); }
EXPORT void __sanitizer_cov_store1(void* p) { access(p, 1, 1); }
EXPORT void __sanitizer_cov_store2(void* p) { access(p, 2, 1); }
EXPORT void __sanitizer_cov_store4(void* p) { access(p, 4, 1); }
EXPORT void __sanitizer_cov_store8(void* p) { access(p, 8, 1); }
EXPORT void __sanitizer_cov_store16(void* p) { access(p, 16, 1); }
// Load/store tracing needs a coverage mode; inline 8-bit counters are the cheapest one.
EXPORT void __sanitizer_cov_8bit_counters_init(char*, char*) {}

// ---------------------------------------------------------------------------------------------
// Guarded buffers: [guard page][data, ending <16 bytes before the next page][guard page].
static size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }

EXPORT char* mlxemu_alloc(int64_t nbytes, int fill, char** map_lo, char** map_hi) {
  size_t pg = page(), body = ((size_t)nbytes + 15) & ~(size_t)15;
  size_t data_pages = (body + pg - 1) / pg;
  if (data_pages == 0) data_pages = 1;
  size_t len = (data_pages + 2) * pg;
  char* m = (char*)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, pg, PROT_NONE);
  mprotect(m + len - pg, pg, PROT_NONE);
  char* data = m + len - pg - body;
  memset(m + pg, fill, len - 2 * pg);
  *map_lo = m;
  *map_hi = m + len;
  return data;
}

EXPORT void mlxemu_free(char* map_lo, char* map_hi) { munmap(map_lo, map_hi - map_lo); }

// ---------------------------------------------------------------------------------------------
// Fibers
HIDDEN void mlxemu_fiber_main(Fiber* f) {
  auto entry = (void (*)(void* const*, const uint32_t*))g_desc->entry;
  entry(g_desc->args, f->attrs);
  f->state = ST_DONE;
  f->done_order = g_done_count++;
  void* dummy;
  mlxemu_swap(&dummy, g_sched_sp);
  __builtin_unreachable();
}

// Makes the pool hold at least n stacks of `stack` bytes (plus guard page) and points the first
// n fibers at them. Grows by replacing the whole mapping; never shrinks.
static int ensure_fibers(size_t n, size_t stack) {
  Pool* P = g_pool;
  size_t pg = page();
  size_t len = (stack + pg - 1) / pg * pg + pg;
  if (!P->stacks || P->n_stacks < n || P->stack_len != len) {
    if (P->stacks) munmap(P->stacks, P->n_stacks * P->stack_len);
    P->stacks = nullptr;
    P->n_stacks = 0;
    char* m = (char*)mmap(nullptr, n * len, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return -1;
    for (size_t i = 0; i < n; ++i)
      if (mprotect(m + i * len, pg, PROT_NONE) != 0) {  // overflow lands here: a stack overflow
        munmap(m, n * len);
        return -1;
      }
    P->stacks = m;
    P->n_stacks = n;
    P->stack_len = len;
  }
  for (size_t i = 0; i < n; ++i) {
    g_fibers[i].stack_lo = P->stacks + i * P->stack_len;
    g_fibers[i].stack_len = P->stack_len;
  }
  return 0;
}

static void fiber_init(Fiber* f) {
  uintptr_t top = ((uintptr_t)(f->stack_lo + f->stack_len)) & ~(uintptr_t)15;
  void** s = (void**)top;
  *--s = nullptr;                          // padding: after the ret below rsp % 16 == 0, so
  *--s = nullptr;                          // mlxemu_fiber_start's call enters with rsp % 16 == 8
  *--s = (void*)&mlxemu_fiber_start;       // where mlxemu_swap's ret goes
  *--s = nullptr;                          // rbp
  *--s = nullptr;                          // rbx
  *--s = (void*)f;                         // r12: the fiber, for mlxemu_fiber_start
  *--s = nullptr;                          // r13
  *--s = nullptr;                          // r14
  *--s = nullptr;                          // r15
  f->sp = s;
  f->state = ST_RUNNABLE;
  f->file = "";
  f->line = f->col = 0;
  f->done_order = -1;
}

// ---------------------------------------------------------------------------------------------
// Calls from kernel code (through the shim).
static void block(int state, int kind, const char* file, int line, int col) {
  Fiber* f = g_cur;
  f->state = state;
  f->kind = kind;
  f->file = file;
  f->line = line;
  f->col = col;
  mlxemu_swap(&f->sp, g_sched_sp);
}

static int same_site(const Fiber* a, const Fiber* b) {
  return a->line == b->line && a->col == b->col && a->kind == b->kind &&
         (a->file == b->file || strcmp(a->file, b->file) == 0);
}

static const char* base(const char* path) {
  const char* s = strrchr(path, '/');
  return s ? s + 1 : path;
}

// `flags` (mem_flags bits) ride in Fiber::size: a barrier without mem_threadgroup still
// synchronises execution but does not order threadgroup memory (no new race epoch).
EXPORT void mlxemu_barrier(int simd_only, int flags, const char* file, int line, int col) {
  g_cur->size = flags;
  if (simd_only) {
    block(ST_SIMD, K_SIMD_BARRIER, file, line, col);
  } else {
    block(ST_BARRIER, 0, file, line, col);
  }
}

// Cost-model counters: kind 0 = exp, 1 = exp2 (one call per lane per element).
EXPORT void mlxemu_count_op(int kind) {
  if (g_desc) g_desc->stats[kind == 0 ? STAT_EXP : STAT_EXP2]++;
}

// From kernel code (metal_simdgroup_matrix.h): report `msg` and stop the thread.
EXPORT void mlxemu_fail(const char* msg) {
  set_error("%s", msg);
  fiber_abort();
}

// simdgroup_multiply_accumulate (metal_simdgroup_matrix.h): lane `lane`'s two elements of
// A * B + C, from the 32 lanes' published fp32 records {a0, a1, b0, b1, c0, c1}. Here, untraced,
// so the gather costs no tracing calls. Layout: MLX's BaseMMAFrag::get_coord (lane l holds row
// (l/4 & 4) + (l/2) % 4, columns (l/4 & 2) * 2 + (l % 2) * 2 and the next), inverted below.
static inline int mma_owner(int r, int c) { return ((r >> 2) << 4) | ((r & 3) << 1) | ((c >> 2) << 3) | ((c >> 1) & 1); }
EXPORT void mlxemu_mma8x8(const float* in, uint32_t lane, float* out) {
#pragma clang fp contract(off)
  const int r = (int)(((lane >> 4) << 2) | ((lane >> 1) & 3));
  const int c = (int)((((lane >> 3) & 1) << 2) | ((lane & 1) << 1));
  for (int i = 0; i < 2; ++i) {
    float acc = in[lane * 6 + 4 + i];
    for (int k = 0; k < 8; ++k)
      acc += in[mma_owner(r, k) * 6 + (k & 1)] * in[mma_owner(k, c + i) * 6 + 2 + ((c + i) & 1)];
    out[i] = acc;
  }
}

// thread_index_in_simdgroup of the running thread (simdgroup_matrix's diagonal constructor).
EXPORT uint32_t mlxemu_lane(void) { return g_cur ? g_cur->attrs[26] : 0; }

// Register model: a thread-private array (or struct holding arrays) of `bytes` was declared at
// site `site` (lower.py numbers them). The estimate is the sum over the sites a launch reached.
EXPORT void mlxemu_regs(int site, uint64_t bytes) {
  uint64_t* s = &g_reg_site[(unsigned)site % N_REG_SITES];
  if (bytes > *s) *s = bytes;
}

EXPORT const void* mlxemu_simd_sync(int kind, const void* value, int size, uint32_t* mask,
                                    uint32_t* lane, const char* file, int line, int col) {
  Fiber* f = g_cur;
  memcpy(f->slot, value, size);
  f->size = size;
  block(ST_SIMD, kind, file, line, col);
  SimdGroup* sg = &g_sg[f->attrs[25]];
  *mask = sg->mask;
  *lane = f->attrs[26];
  return sg->snap;
}

// ---------------------------------------------------------------------------------------------
// Scheduler
static uint64_t g_rng;
static uint64_t rng_next() {
  g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
  return g_rng * 0x2545F4914F6CDD1Dull;
}

static void make_order(int* perm, int n) {
  for (int i = 0; i < n; ++i) perm[i] = g_desc->order == 1 ? n - 1 - i : i;
  if (g_desc->order == 2)
    for (int i = n - 1; i > 0; --i) { int j = (int)(rng_next() % (uint64_t)(i + 1)); int t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
}

static const char* state_name(const Fiber* f) {
  switch (f->state) {
    case ST_SIMD: return f->kind == K_SIMD_BARRIER ? "simdgroup_barrier" : "a SIMD-group function";
    case ST_BARRIER: return "threadgroup_barrier";
    case ST_DONE: return "the end of the kernel";
    default: return "running";
  }
}

// Resolve what can be resolved once no fiber is runnable. Returns 1 if anything was released.
static int resolve() {
  int released = 0;
  int nsg = (g_n + 31) / 32;
  for (int s = 0; s < nsg; ++s) {
    Fiber* lanes = g_fibers + s * 32;
    int cnt = g_n - s * 32 < 32 ? g_n - s * 32 : 32;
    int live = 0, at = 0;
    const Fiber* first = nullptr;
    for (int i = 0; i < cnt; ++i) {
      if (lanes[i].state == ST_DONE) continue;
      ++live;
      if (lanes[i].state == ST_SIMD) { ++at; if (!first) first = &lanes[i]; }
    }
    if (!live || at == 0) continue;
    if (at != live) continue;  // some lanes at a barrier: reported below if nothing else moves
    for (int i = 0; i < cnt; ++i) {
      const Fiber* f = &lanes[i];
      if (f->state != ST_DONE && !same_site(f, first)) {
        g_cur = (Fiber*)f;
        set_error("divergent SIMD-group function: lanes %d and %d of simdgroup %d wait at different "
                  "call sites, %s:%d:%d and %s:%d:%d (a SIMD-group function in divergent control flow)",
                  (int)(first - lanes), i, s, base(first->file), first->line, first->col,
                  base(f->file), f->line, f->col);
        return 0;
      }
    }
    SimdGroup* sg = &g_sg[s];
    sg->mask = 0;
    int size = first->kind == K_SIMD_BARRIER ? 0 : first->size;  // a barrier's size holds its flags
    memset(sg->snap, 0xFF, sizeof sg->snap);
    for (int i = 0; i < cnt; ++i) {
      if (lanes[i].state == ST_DONE) continue;
      sg->mask |= 1u << i;
      memcpy(sg->snap + i * size, lanes[i].slot, size);
      lanes[i].state = ST_RUNNABLE;
    }
    g_desc->stats[STAT_SIMD_OPS]++;
    if (first->kind == 1) g_desc->stats[STAT_SHUFFLES]++;       // MLXEMU_K_SHUFFLE
    else if (first->kind == 2) g_desc->stats[STAT_REDUCTIONS]++;  // MLXEMU_K_REDUCE
    else if (first->kind == K_MMA) g_desc->stats[STAT_MMA]++;
    else if (first->kind == K_MLOAD) g_desc->stats[STAT_MLOAD]++;
    else if (first->kind == K_MSTORE) g_desc->stats[STAT_MSTORE]++;
    // A simdgroup_barrier orders threadgroup memory only with mem_threadgroup in its flags.
    if (first->kind != K_SIMD_BARRIER || (first->size & MEM_THREADGROUP)) g_sepoch[s]++;
    released = 1;
  }
  if (released) return 1;
  // Barrier: every live thread must wait at it, at the same site.
  const Fiber* first = nullptr;
  int live = 0, at = 0;
  for (int i = 0; i < g_n; ++i) {
    if (g_fibers[i].state == ST_DONE) continue;
    ++live;
    if (g_fibers[i].state == ST_BARRIER) { ++at; if (!first) first = &g_fibers[i]; }
  }
  if (live && at == live) {
    for (int i = 0; i < g_n; ++i) {
      Fiber* f = &g_fibers[i];
      if (f->state == ST_BARRIER && !same_site(f, first)) {
        g_cur = f;
        set_error("threadgroup_barrier in divergent control flow: threads %u and %u wait at "
                  "different barriers, %s:%d:%d and %s:%d:%d", first->attrs[24], f->attrs[24],
                  base(first->file), first->line, first->col, base(f->file), f->line, f->col);
        return 0;
      }
    }
    if (live < g_n) {
      g_desc->stats[4]++;
      if (g_desc->strict_barriers) {
        g_cur = (Fiber*)first;
        set_error("threadgroup_barrier reached while %d threads of the threadgroup had already "
                  "returned (barrier in divergent control flow)", g_n - live);
        return 0;
      }
    }
    for (int i = 0; i < g_n; ++i)
      if (g_fibers[i].state == ST_BARRIER) g_fibers[i].state = ST_RUNNABLE;
    g_desc->stats[STAT_BARRIERS]++;
    if (first->size & MEM_THREADGROUP) g_epoch++;  // else: execution only, memory unordered
    else g_desc->stats[STAT_NOFENCE_BARRIERS]++;
    return 1;
  }
  // Stuck: describe the first simdgroup whose lanes disagree, else the barrier split.
  for (int i = 0; i < g_n; ++i) {
    Fiber* f = &g_fibers[i];
    if (f->state == ST_SIMD) {
      for (int j = (i / 32) * 32; j < g_n && j < (i / 32) * 32 + 32; ++j) {
        if (g_fibers[j].state != ST_SIMD && g_fibers[j].state != ST_DONE) {
          g_cur = f;
          set_error("deadlock: thread %d waits in %s at %s:%d:%d while thread %d of its simdgroup "
                    "waits at %s at %s:%d:%d (SIMD-group function or barrier in divergent control flow)",
                    i, state_name(f), base(f->file), f->line, f->col, j, state_name(&g_fibers[j]),
                    base(g_fibers[j].file), g_fibers[j].line, g_fibers[j].col);
          return 0;
        }
      }
    }
  }
  g_cur = (Fiber*)first;
  set_error("deadlock: no thread can make progress");
  return 0;
}

static void coord(int lin, const int* dims, uint32_t* out) {
  out[0] = lin % dims[0];
  out[1] = (lin / dims[0]) % dims[1];
  out[2] = lin / (dims[0] * dims[1]);
}

static int run_threadgroup(const int* tgpos, const int* ntg, int* perm) {
  const int* grid = g_desc->grid;
  const int* tg = g_desc->tg;
  int dims[3];
  for (int d = 0; d < 3; ++d) {
    int rem = grid[d] - tgpos[d] * tg[d];
    dims[d] = rem < tg[d] ? rem : tg[d];  // dispatchThreads: edge threadgroups are smaller
  }
  int n = dims[0] * dims[1] * dims[2];
  int req = tg[0] * tg[1] * tg[2];
  g_n = n;
  g_done_count = 0;
  if (__start_mlxemu_tg && __stop_mlxemu_tg > __start_mlxemu_tg)  // fallback statics
    memset(__start_mlxemu_tg, 0xFF, __stop_mlxemu_tg - __start_mlxemu_tg);
  memset(g_arena, 0xFF, g_arena_used);  // NaN / 0xFF.. until written
  memset(g_shadow, 0, g_arena_used * sizeof(Shadow));
  g_epoch = 1;
  for (int k = 0; k < 32; ++k) g_sepoch[k] = 1;
  for (int i = 0; i < n; ++i) {
    Fiber* f = &g_fibers[i];
    fiber_init(f);
    uint32_t* a = f->attrs;
    uint32_t local[3];
    coord(i, dims, local);
    for (int d = 0; d < 3; ++d) {
      a[0 + d] = tgpos[d] * tg[d] + local[d];  // thread_position_in_grid
      a[3 + d] = tgpos[d];                     // threadgroup_position_in_grid
      a[6 + d] = local[d];                     // thread_position_in_threadgroup
      a[9 + d] = dims[d];                      // threads_per_threadgroup
      a[12 + d] = tg[d];                       // dispatch_threads_per_threadgroup
      a[15 + d] = ntg[d];                      // threadgroups_per_grid
      a[18 + d] = grid[d];                     // threads_per_grid, grid_size
      a[21 + d] = 0;                           // grid_origin
    }
    a[24] = i;                                 // thread_index_in_threadgroup
    a[25] = i / 32;                            // simdgroup_index_in_threadgroup
    a[26] = i % 32;                            // thread_index_in_simdgroup
    a[27] = 32;                                // threads_per_simdgroup
    a[28] = (n + 31) / 32;                     // simdgroups_per_threadgroup
    a[29] = (req + 31) / 32;                   // dispatch_simdgroups_per_threadgroup
    a[30] = i / 4;                             // quadgroup_index_in_threadgroup
    a[31] = i % 4;                             // thread_index_in_quadgroup
    a[32] = (n + 3) / 4;                       // quadgroups_per_threadgroup
    a[33] = (req + 3) / 4;                     // dispatch_quadgroups_per_threadgroup
    a[34] = 32;                                // thread_execution_width
  }
  for (;;) {
    make_order(perm, n);
    int live = 0;
    for (int k = 0; k < n; ++k) {
      Fiber* f = &g_fibers[perm[k]];
      if (f->state != ST_RUNNABLE) continue;
      g_cur = f;
      mlxemu_swap(&g_sched_sp, f->sp);
      if (g_has_err) return -1;
    }
    g_cur = nullptr;
    for (int i = 0; i < n; ++i) live += g_fibers[i].state != ST_DONE;
    if (!live) break;
    if (!resolve()) return -1;
  }
  g_desc->stats[0] += n;
  g_desc->stats[1] += 1;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Faults: name the buffer (or stack) an access hit, then abandon the launch.
static char g_altstack[1 << 16];
static struct sigaction g_old_segv, g_old_bus, g_old_alrm;
static stack_t g_old_altstack;
static timer_t g_timer;
// The watchdog is a per-thread timer on a real-time signal: it can only interrupt the thread
// running the launch, and never collides with Python's SIGALRM.
static int watchdog_signal() { return SIGRTMIN + 4; }

static void on_fault(int sig, siginfo_t* si, void* uctx) {
  if (sig == watchdog_signal()) {
    set_error("the launch did not finish within %lld s (an endless loop? raise MLXPAGED_EMU_TIMEOUT)",
              (long long)g_desc->timeout_s);
    siglongjmp(g_jmp, 1);
  }
  const char* p = (const char*)si->si_addr;
  for (int64_t i = 0; g_desc && i < g_desc->n_buffers; ++i) {
    Buffer* b = &g_desc->buffers[i];
    if (p >= b->map_lo && p < b->map_hi) {
      set_error("out-of-bounds access to buffer '%s' at byte offset %lld (buffer is %lld bytes)",
                b->name, (long long)(p - b->lo), (long long)(b->hi - b->lo));
      siglongjmp(g_jmp, 1);
    }
  }
  if (g_arena && p >= g_arena + TG_CAP && p < g_arena + TG_CAP + page()) {
    set_error("out-of-bounds access past all threadgroup memory");
    siglongjmp(g_jmp, 1);
  }
  // A frame larger than the guard page jumps over it, so also look at where the faulting
  // thread's stack pointer went: below its own stack means it overflowed.
  uintptr_t sp = (uintptr_t)((ucontext_t*)uctx)->uc_mcontext.gregs[REG_RSP];
  bool sp_below = g_cur && sp < (uintptr_t)g_cur->stack_lo + page() &&
                  sp + (64u << 20) > (uintptr_t)g_cur->stack_lo;
  if (sp_below || (g_pool && g_pool->stacks && p >= g_pool->stacks &&
      p < g_pool->stacks + g_pool->n_stacks * g_pool->stack_len &&
      (size_t)(p - g_pool->stacks) % g_pool->stack_len < page())) {
    set_error("stack overflow in a GPU thread (raise MLXPAGED_EMU_STACK)");
    siglongjmp(g_jmp, 1);
  }
  set_error("%s at address %p in kernel code", sig == SIGBUS ? "bus error" : "segmentation fault", (void*)p);
  siglongjmp(g_jmp, 1);
}

static void install_handlers() {
  stack_t ss;
  ss.ss_sp = g_altstack;
  ss.ss_size = sizeof g_altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, &g_old_altstack);  // faults may be stack overflows: handle them elsewhere
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  if (g_desc->timeout_s > 0) {
    sigaction(watchdog_signal(), &sa, &g_old_alrm);
    struct sigevent se;
    memset(&se, 0, sizeof se);
    se.sigev_notify = SIGEV_THREAD_ID;
    se.sigev_signo = watchdog_signal();
    se._sigev_un._tid = (pid_t)syscall(SYS_gettid);
    struct itimerspec t;
    memset(&t, 0, sizeof t);
    t.it_value.tv_sec = g_desc->timeout_s;
    if (timer_create(CLOCK_MONOTONIC, &se, &g_timer) == 0) timer_settime(g_timer, 0, &t, nullptr);
    else g_desc->timeout_s = 0;
  }
}

static void restore_handlers() {
  if (g_desc->timeout_s > 0) {
    timer_delete(g_timer);
    sigaction(watchdog_signal(), &g_old_alrm, nullptr);
  }
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaltstack(&g_old_altstack, nullptr);
}

EXPORT size_t mlxemu_tg_bytes() {
  size_t statics = (__start_mlxemu_tg && __stop_mlxemu_tg) ? (size_t)(__stop_mlxemu_tg - __start_mlxemu_tg) : 0;
  return g_tg_bytes + statics;
}

// Runs a whole launch. Returns 0, or -1 with the message in `err`.
EXPORT int mlxemu_launch(LaunchDesc* d, char* err, int errlen) {
  g_desc = d;
  memset(g_reg_site, 0, sizeof g_reg_site);
  g_has_err = 0;
  g_err[0] = 0;
  g_cur = nullptr;
  g_rng = d->seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  if (!g_rng) g_rng = 1;
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (int64_t i = 0; i < d->n_buffers; ++i) {
    if ((uintptr_t)d->buffers[i].map_lo < lo) lo = (uintptr_t)d->buffers[i].map_lo;
    if ((uintptr_t)d->buffers[i].map_hi > hi) hi = (uintptr_t)d->buffers[i].map_hi;
  }
  int ntg[3];
  for (int k = 0; k < 3; ++k) ntg[k] = (d->grid[k] + d->tg[k] - 1) / d->tg[k];
  int req = d->tg[0] * d->tg[1] * d->tg[2];
  if (req > 1024) { snprintf(err, errlen, "threadgroup of %d threads exceeds 1024", req); g_desc = nullptr; return -1; }
  g_pool = d->pool ? (Pool*)d->pool : &g_own_pool;
  if (g_pool->magic != POOL_MAGIC) {
    if (g_pool->magic != 0) {  // cannot happen (see Pool); never free what we cannot read
      snprintf(err, errlen, "the shared launch pool belongs to another runtime version");
      g_desc = nullptr;
      return -1;
    }
    memset(g_pool, 0, sizeof *g_pool);
    g_pool->magic = POOL_MAGIC;
  }
  if (ensure_fibers(req, (size_t)d->stack_size) != 0) { snprintf(err, errlen, "cannot allocate fiber stacks"); g_desc = nullptr; return -1; }
  if (!g_pool->arena) {
    char* a = (char*)mmap(nullptr, TG_CAP + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void* sh = mmap(nullptr, TG_CAP * sizeof(Shadow), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED || sh == MAP_FAILED) {
      if (a != MAP_FAILED) munmap(a, TG_CAP + page());
      if (sh != MAP_FAILED) munmap(sh, TG_CAP * sizeof(Shadow));
      snprintf(err, errlen, "cannot allocate threadgroup memory");
      g_desc = nullptr;
      return -1;
    }
    mprotect(a + TG_CAP, page(), PROT_NONE);
    g_pool->arena = a;
    g_pool->shadow = sh;
  }
  g_arena = g_pool->arena;
  g_shadow = (Shadow*)g_pool->shadow;
  int perm[1024];
  long total = (long)ntg[0] * ntg[1] * ntg[2];
  // Threadgroup order follows the lane order too (forward, reverse, shuffled).
  long* tgs = (long*)mmap(nullptr, (total ? total : 1) * sizeof(long), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  for (long i = 0; i < total; ++i) tgs[i] = d->order == 1 ? total - 1 - i : i;
  if (d->order == 2)
    for (long i = total - 1; i > 0; --i) { long j = (long)(rng_next() % (uint64_t)(i + 1)); long t = tgs[i]; tgs[i] = tgs[j]; tgs[j] = t; }
  int rc = 0;
  install_handlers();
  g_lo = lo;
  g_span = hi > lo ? hi - lo : 0;
  if (sigsetjmp(g_jmp, 1) == 0) {
    for (long t = 0; t < total && rc == 0; ++t) {
      int pos[3] = {(int)(tgs[t] % ntg[0]), (int)((tgs[t] / ntg[0]) % ntg[1]), (int)(tgs[t] / ((long)ntg[0] * ntg[1]))};
      rc = run_threadgroup(pos, ntg, perm);
    }
  } else {
    rc = -1;
  }
  g_span = 0;
  d->stats[STAT_TG_BYTES] = mlxemu_tg_bytes();
  for (int k = 0; k < N_REG_SITES; ++k) {
    d->stats[STAT_REG_BYTES] += g_reg_site[k];
    if (k >= N_REG_SITES / 2) d->stats[STAT_SCALAR_REG_BYTES] += g_reg_site[k];
  }
  for (int64_t i = 0; i < d->n_buffers; ++i) {
    Buffer* b = &d->buffers[i];
    if (!b->written_map) continue;
    uint64_t set = 0, n = (uint64_t)(b->hi - b->lo);
    for (uint64_t k = 0; k < n / 8; ++k) set += __builtin_popcount(b->written_map[k]);
    for (uint64_t k = n / 8 * 8; k < n; ++k) set += b->written_map[k >> 3] >> (k & 7) & 1;
    b->bytes_unwritten = n - set;
  }
  g_atomic_depth = 0;
  restore_handlers();
  munmap(tgs, (total ? total : 1) * sizeof(long));
  if (rc != 0) snprintf(err, errlen, "%s", g_err[0] ? g_err : "kernel failed");
  g_desc = nullptr;
  g_cur = nullptr;
  return rc;
}

// ---------------------------------------------------------------------------------------------
// bfloat16 conversion builtins. Without a native instruction (compiler.py turns AVX512-BF16 off:
// it flushes subnormals), clang lowers float -> __bf16 to a call of __truncsfbf2, which many
// runtime libraries lack: zig's compiler-rt has none, Debian 12's clang links libgcc 12 (no bf16
// before GCC 13); the library then fails to load ("undefined symbol: __truncsfbf2").
// Weak, so a strong definition linked in alongside takes precedence instead of clashing; hidden,
// so each library binds its own copy, never one from elsewhere in the process.
// Invariants: round to nearest, ties to even; overflow gives +-inf; subnormals are kept (no
// flush); a NaN stays a NaN of the same sign, made quiet, keeping the top of its payload (as
// compiler-rt and libgcc do). bf16 -> float needs no builtin: clang inlines that shift.

static inline uint16_t bf16_from_f32(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);  // NaN: quiet
  // Adding 0x7fff plus the kept LSB rounds half to even; a carry out of the mantissa bumps the
  // exponent, which is also right at the top (float max -> inf).
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline uint16_t bf16_from_f64(double d) {
  if (d != d) return bf16_from_f32((float)d);  // the cast keeps sign and top payload
  // Round to odd into float (16 spare bits), then to nearest even into bf16: one correct
  // rounding, no double-rounding error (a plain (float)d would round twice).
  float f = (float)d;
  if ((double)f != d) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (__builtin_fabs((double)f) > __builtin_fabs(d)) x -= 1;  // truncate toward zero
    x |= 1u;                                                     // sticky: make it odd
    memcpy(&f, &x, 4);
  }
  return bf16_from_f32(f);
}

#define BF16_BUILTIN extern "C" __attribute__((weak, visibility("hidden")))
BF16_BUILTIN __bf16 __truncsfbf2(float f) {
  uint16_t b = bf16_from_f32(f);
  __bf16 r;
  memcpy(&r, &b, 2);  // a bit copy: a conversion here would call this function again
  return r;
}
BF16_BUILTIN __bf16 __truncdfbf2(double d) {
  uint16_t b = bf16_from_f64(d);
  __bf16 r;
  memcpy(&r, &b, 2);
  return r;
}

// The same conversions under names no runtime library defines, for tests (ctypes).
EXPORT uint16_t mlxemu_bf16_from_float(float f) { return bf16_from_f32(f); }
EXPORT uint16_t mlxemu_bf16_from_double(double d) { return bf16_from_f64(d); }
