"""The device fills, each beside its launcher; only the builder and its graph mode launch them.

* ``triton_fill``: the Triton kernel (every CUDA layout, graph mode, and CPU tensors under
  Triton's interpreter). Importing it imports triton, so it is imported on first use.
* ``cuda_fill``: the CUDA C fill, compiled with NVRTC, launched by the C build.
* ``torch_fill``: the same tables in vectorized torch ops (CPU tensors, devices without Triton).

A CPU ``StepTablesBuilder``'s C build fills its tables itself (``cpu_fill_entry`` in
``chunkmeta/csrc/host_build.c``, launched from ``chunkmeta.native``'s step build): the step
kernel's logic run serially, after the layout's first build ran the torch fill.
"""
