// Instruction-set detection shared by every CPU kernel table (see cpu_isa.h).
#include "cpu_isa.h"

#include <stdlib.h>

namespace exl {
namespace isa {
namespace {

const char* const kNames[kLevels] = {"scalar", "avx2", "avxvnni", "avx512vnni"};

bool detect(Level level) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  switch (level) {
    case kScalar: return true;
    case kAvx2: return avx2;
#if defined(__clang__) || __GNUC__ >= 11
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
#else
    case kAvxVnni: return false;  // the compiler knows no AVX-VNNI
#endif
    case kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return level == kScalar;
#endif
}

}  // namespace

const char* name(Level level) { return kNames[level]; }

bool parse(const std::string& s, Level* level) {
  for (int i = 0; i < kLevels; ++i)
    if (s == kNames[i]) {
      *level = Level(i);
      return true;
    }
  return false;
}

bool supported(Level level) {
  static const bool has[kLevels] = {detect(kScalar), detect(kAvx2), detect(kAvxVnni), detect(kAvx512Vnni)};
  return has[level];
}

Level best() {
  for (int i = kLevels - 1; i > 0; --i)
    if (supported(Level(i))) return Level(i);
  return kScalar;
}

std::string all_names() {
  std::string out;
  for (int i = 0; i < kLevels; ++i) out += std::string(i ? ", " : "") + kNames[i];
  return out;
}

bool resolve(const std::string& request, Level* level, std::string* error) {
  std::string want = request;
  const char* from = "";
  if (want.empty() || want == "auto") {
    const char* env = getenv("EXL_CPU_ISA");
    if (!env || !*env || std::string(env) == "auto") {
      *level = best();
      return true;
    }
    want = env;
    from = " (from EXL_CPU_ISA)";
  }
  if (!parse(want, level)) {
    *error = "isa must be 'auto' or one of " + all_names() + ", got '" + want + "'" + from;
    return false;
  }
  if (!supported(*level)) {
    *error = "instruction set '" + want + "'" + from + " is not available on this CPU (best here: " + name(best()) +
             "); use 'auto' or a lower level";
    return false;
  }
  return true;
}

}  // namespace isa
}  // namespace exl
