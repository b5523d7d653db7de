#include "cprocess.h"
#include <malloc.h>
#include <sys/prctl.h>

int cprocess_make_undumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

void cprocess_tune_malloc(void) {
    mallopt(M_ARENA_MAX, 4);
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    mallopt(M_TRIM_THRESHOLD, 1024 * 1024);
}

int cprocess_malloc_trim(void) { return malloc_trim(0); }
