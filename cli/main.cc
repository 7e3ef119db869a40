#include "core/status.h"
int main(int, char**) { return 0; }
