// The one instruction-set detection layer of the CPU code: the GEMV tables (cpu_ops.cpp) and the
// fused ops (cpu_fused.cpp) both ask here which levels this CPU runs and what a requested name
// ("auto", EXL_CPU_ISA, or an explicit level) means. Plain C++, no torch.
//
// Levels, each a superset of the one before:
//   scalar      baseline x86-64 (or any other architecture)
//   avx2        AVX2 + FMA + F16C
//   avxvnni     the above + AVX-VNNI (vpdpbusd on 256-bit vectors)
//   avx512vnni  the above but AVX-VNNI + AVX-512 F/BW/VL/DQ + AVX512-VNNI
#pragma once
#include <string>
#include <vector>

namespace exl {
namespace isa {

enum Level { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };
constexpr int kLevels = 4;

const char* name(Level level);
// The level called `s`; false when `s` names none.
bool parse(const std::string& s, Level* level);
// Whether this CPU (and this build's compiler) runs code of this level.
bool supported(Level level);
// The best supported level.
Level best();
// Every level's name, comma-separated (for error messages).
std::string all_names();
// The level a request means: "" or "auto" -> EXL_CPU_ISA when set, else best(). Anything else must
// name a supported level; otherwise *error says what is wrong and what to do, and false is returned.
bool resolve(const std::string& request, Level* level, std::string* error);

}  // namespace isa
}  // namespace exl
