/* Low-level libfuse3 API at version 3.12: at 312 fuse_session_loop_mt is a real (versioned)
 * symbol instead of a macro Swift cannot import. Must be defined before the include. */
#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <sys/xattr.h>
