// The fused kernels' one translation unit (`fused.py` compiles this file): ATen's headers are parsed once rather than
// once per source, so a cold build takes ~24 s of CPU instead of ~43 as four units (each of the suite's three builds,
// and a user's first). Each source stays self-contained: its own includes, guards and namespaces.
#include "int8.cpp"
#include "bf16.cpp"
#include "snake.cpp"
#include "fused.cpp"
