// Placeholder translation unit: implementation in progress.
#include "core/format/pickle.h"
