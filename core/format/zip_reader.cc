// Placeholder translation unit: implementation in progress.
#include "core/format/zip_reader.h"
