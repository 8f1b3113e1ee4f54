"""Import this BEFORE any sglang module when running the .py-only SGLang bundle.

The bundle carries SGLang 0.5.23's .py files only (no compiled extensions). On a CUDA host many
SGLang modules do a hard ``from sgl_kernel import ...`` at import time (sglang-kernel: SGLang's
compiled CUDA ops, built for one torch release); on the way to ForwardBatch and the hybrid linear
attention backends, ``layers.quantization``'s compressed-tensors schemes do. This registers a
stand-in package for it (only where no real sgl_kernel is installed): importing works, calling
anything taken from it raises RuntimeError. The metadata builders and the Triton SSD ops that
chunkmeta's SGLang tests and benchmark run are torch / Triton code and never call it.
"""

import bundle_stubs  # bench/bundle, copied into the bundle beside this file

bundle_stubs.install(("sgl_kernel",), owner="sglang_bootstrap", packages=True)
