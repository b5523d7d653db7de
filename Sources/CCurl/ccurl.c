/* SwiftPM needs one C source file for a C target; everything lives in ccurl.h. */
#include "ccurl.h"
