// DLPack arrays (NumPy arrays, torch tensors or raw DLPack capsules) as sage::TensorView.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <vector>

#include "sage/tensor.h"

namespace sagepy {

namespace nb = nanobind;

// A view only borrows memory, so whoever makes views must keep the producer's DLPack
// handle alive until the library is done with them: a ViewSet owns those handles for
// the duration of one call.
class ViewSet {
 public:
  // `obj` may be read-only. None gives an undefined view (an omitted optional argument).
  sage::TensorView input(nb::handle obj, const char* name);
  // `obj` must be writable; None gives an undefined view.
  sage::TensorView output(nb::handle obj, const char* name);
  // Raw bytes of a flat buffer: returns its address and writes its size in bytes. A buffer
  // the library only reads (quantized K/V handed back to the attention kernel) may be
  // read-only; one it writes must be writable.
  void* bytes(nb::handle obj, const char* name, size_t* size, sage::Device* device,
              bool read_only = false);

 private:
  std::vector<nb::ndarray<nb::ro>> read_only_;
  std::vector<nb::ndarray<>> writable_;
};

// A DLPack device (type, id) as the library's Device; throws sage::Error naming `name`
// for devices the library cannot address.
sage::Device device_of(int dlpack_device_type, int device_id, const char* name);

}  // namespace sagepy
