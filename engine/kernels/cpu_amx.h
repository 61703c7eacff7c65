/* AMX's tile registers for the kernels that multiply through them (cpu_quant_amx.h,
 * cpu_prefill_blocks.h): whether this process may use them, and a tile configuration.
 * Each library that includes this asks Linux once (arch_prctl ARCH_REQ_XCOMP_PERM)
 * and has its own switch (``amx_allowed``: tests run the other paths with it off).
 * A kernel loads its configuration before its tiles (another library, oneDNN, may
 * have loaded its own on the thread in between) and releases them after.
 *
 * HAVE_AMX_BF16: the build's target has AMX-TILE and AMX-BF16 (on Linux). */
#ifndef SHARDLINE_CPU_AMX_H
#define SHARDLINE_CPU_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX_BF16 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_allowed = 1;

/* Whether this process may use the tile registers (asked once) and the tiles are allowed. */
static int amx_ready(void) {
    static int state = -1;  /* -1: not asked yet */
    if (!__atomic_load_n(&amx_allowed, __ATOMIC_RELAXED)) return 0;
    int ready = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (ready < 0) {
        ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&state, ready, __ATOMIC_RELEASE);
    }
    return ready;
}

/* Loads a palette-1 tile configuration: tile t has rows[t] rows of bytes[t] bytes. */
static inline void amx_load_config(int tiles, const uint8_t *rows, const uint16_t *bytes) {
    struct __attribute__((packed)) {
        uint8_t palette, start;
        uint8_t reserved[14];
        uint16_t bytes[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < tiles; t++) {
        config.rows[t] = rows[t];
        config.bytes[t] = bytes[t];
    }
    _tile_loadconfig(&config);
}

#else
#define HAVE_AMX_BF16 0

static int amx_allowed = 0;
static inline int amx_ready(void) { return 0; }
#endif

#endif
