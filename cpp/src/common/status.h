// Error reporting for the C API: status codes plus a thread-local message; never abort().
#pragma once

#include <cstdarg>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "fusible/common.h"

namespace fusible {

// Records the message for fus_last_error() and returns code.
fus_status set_error(fus_status code, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

void clear_error();
const char* last_error();

// Thrown inside the library by checks deep in a call; converted to a status at the API boundary.
struct Error : std::exception {
  fus_status code;
  std::string message;
  Error(fus_status c, std::string m) : code(c), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// Runs body (returning fus_status) and converts any exception into a status + message.
template <typename F>
fus_status guarded(const char* fn, F&& body) noexcept {
  clear_error();
  try {
    return body();
  } catch (const Error& e) {
    return set_error(e.code, "%s", e.message.c_str());
  } catch (const std::exception& e) {
    return set_error(FUS_ERROR_INTERNAL, "%s: internal error: %s", fn, e.what());
  } catch (...) {
    return set_error(FUS_ERROR_INTERNAL, "%s: unknown internal error", fn);
  }
}

const char* dtype_name(fus_dtype dtype);

// Whether a family table's values (its value column, in row order) are 0, 1, ...: each family
// indexes an array of its table's rows by value.
constexpr bool values_are_row_indices(std::initializer_list<int> values) {
  int row = 0;
  for (const int v : values)
    if (v != row++) return false;
  return true;
}

// "A, B or C": the items joined by ", " and a last " or " (for the messages listing a table).
std::string or_list(const std::vector<std::string>& items);

// The enumerator's name of a scaling mode ("FUS_SCALING_PER_TENSOR"), nullptr for a value that is
// not a mode (FUS_SCALING_MODE_TABLE, fusible/common.h).
const char* scaling_mode_c_name(fus_scaling_mode mode);

}  // namespace fusible
