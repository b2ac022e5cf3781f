// Error types of sparse_attn.
//
// Every failure the library reports is one of these. The two user-facing kinds mirror the
// seed API's Python exceptions: ValueError (a value, shape, layout or option is wrong) and
// TypeError (a dtype or argument kind is wrong). The Python binding maps them one to one.
// Messages name the argument, say what was expected and what came.
#pragma once

#include <stdexcept>
#include <string>

namespace sparse_attn {

// Base of every exception the library throws. Thrown directly for failures that are no
// caller's fault (a CUDA runtime error, an allocation failure).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value, shape, stride, device or option is wrong (Python: ValueError).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A dtype or argument kind is wrong (Python: TypeError).
class TypeError : public Error {
 public:
  using Error::Error;
};

// The call is valid, but the chosen backend does not implement this combination
// (Python: ValueError, as the seed raises for unsupported native combinations).
// There is never a silent fallback to another backend.
class NotSupportedError : public ValueError {
 public:
  using ValueError::ValueError;
};

}  // namespace sparse_attn
