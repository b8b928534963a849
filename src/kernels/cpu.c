/* Which instruction sets this CPU runs (kernels.h): detected once with CPUID and XGETBV
 * (the OS must save the wide registers too), capped by BLADE_ISA or blade_isa_set so any
 * path can be run and compared on one machine. */

#include "blade/kernels.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

static blade_cpu_features features;
static pthread_once_t features_once = PTHREAD_ONCE_INIT;
static _Atomic int active_isa = -1;

#if defined(__x86_64__)
/* XGETBV is issued as raw asm so this file needs no -mxsave; only called once CPUID has
 * reported OSXSAVE, without which the instruction faults. */
static uint64_t read_xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void detect(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return;
    bool osxsave = c & (1u << 27), avx = c & (1u << 28);
    bool fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave || !avx)
        return;
    uint64_t xcr0 = read_xcr0();
    /* The CPU may implement AVX/AVX-512 while the OS does not save their registers on a
     * context switch; XCR0 says what the OS enabled: SSE+AVX state (bits 1-2), and for
     * AVX-512 also the opmask and both halves of the upper ZMM state (bits 5-7). */
    bool os_avx = (xcr0 & 0x6) == 0x6;
    bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
    if (!os_avx)
        return;
    features.fma = fma;
    features.f16c = f16c;
    if (__get_cpuid_max(0, NULL) < 7)
        return;
    __cpuid_count(7, 0, a, b, c, d);
    unsigned max_sub7 = a;
    features.avx2 = b & (1u << 5);
    features.gfni = c & (1u << 8);
    if (!os_avx512)
        return;
    features.avx512f = b & (1u << 16);
    features.avx512bw = b & (1u << 30);
    features.avx512vl = b & (1u << 31);
    features.avx512vnni = c & (1u << 11);
    if (max_sub7 >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        features.avx512bf16 = a & (1u << 5);
    }
}
#else
static void detect(void)
{
}
#endif

const blade_cpu_features *blade_cpu_get_features(void)
{
    pthread_once(&features_once, detect);
    return &features;
}

const char *blade_isa_name(blade_isa isa)
{
    switch (isa) {
    case BLADE_ISA_SCALAR:
        return "scalar";
    case BLADE_ISA_AVX2:
        return "avx2";
    case BLADE_ISA_AVX512:
        return "avx512";
    default:
        return "unknown";
    }
}

bool blade_isa_supported(blade_isa isa)
{
    const blade_cpu_features *f = blade_cpu_get_features();
    switch (isa) {
    case BLADE_ISA_SCALAR:
        return true;
    case BLADE_ISA_AVX2:
        return f->avx2 && f->fma && f->f16c;
    case BLADE_ISA_AVX512:
        return blade_isa_supported(BLADE_ISA_AVX2) && f->avx512f && f->avx512bw && f->avx512vl;
    default:
        return false;
    }
}

/* BLADE_ISA=scalar|avx2|avx512 caps the default, so a run can be compared against a
 * narrower machine's arithmetic without rebuilding. */
static blade_isa default_isa(void)
{
    blade_isa best = BLADE_ISA_SCALAR;
    for (int i = BLADE_ISA_COUNT - 1; i > 0; i--) {
        if (blade_isa_supported((blade_isa)i)) {
            best = (blade_isa)i;
            break;
        }
    }
    const char *env = getenv("BLADE_ISA");
    if (env) {
        for (int i = 0; i < BLADE_ISA_COUNT; i++)
            if (strcasecmp(env, blade_isa_name((blade_isa)i)) == 0 && i < (int)best)
                best = (blade_isa)i;
    }
    return best;
}

blade_isa blade_isa_active(void)
{
    int isa = atomic_load_explicit(&active_isa, memory_order_relaxed);
    if (isa < 0) {
        int expected = -1;
        atomic_compare_exchange_strong(&active_isa, &expected, (int)default_isa());
        isa = atomic_load(&active_isa);
    }
    return (blade_isa)isa;
}

void blade_isa_set(blade_isa isa)
{
    if (blade_isa_supported(isa))
        atomic_store(&active_isa, (int)isa);
}
