#include "cprocess.h"
#include <malloc.h>
#include <sys/prctl.h>

int cprocess_make_undumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

int cprocess_malloc_trim(void) { return malloc_trim(0); }

int cprocess_limit_arenas(int arenas) { return mallopt(M_ARENA_MAX, arenas); }
